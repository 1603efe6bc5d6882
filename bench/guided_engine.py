"""Guided decoding's cost inside one vLLM engine: the same chats with and without the review schema.

One ``LLM`` (so engine start is out of both figures), modes alternating, ``--repeats`` each, greedy. The plain
mode runs with ``ignore_eos`` to the same ``max_tokens`` so its work is fixed; the guided mode stops where the
JSON object ends. Both are timed from ``llm.chat`` call to outputs in memory, and compared per generated token
(the work differs in length; ``python -m bench guided`` measures the whole pipeline).

    .venv/bin/python -m bench guided-engine --rows 8 --repeats 3
"""
from __future__ import annotations

import argparse
import json
import time

from bench.runners import RESULTS, ROOT, alternating, append_jsonl, spread_text


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the demo model")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(RESULTS / "guided_engine_cpu.jsonl"))
    a = ap.parse_args(argv)
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    if a.model is None:
        from batch_llm.demo_model import build_demo_model

        a.model = str(build_demo_model())
    schema = json.loads((ROOT / "dags" / "pipelines" / "schemas" / "review_opinion.json").read_text())
    reviews = [json.loads(x)["prompt"] for x in (ROOT / "include" / "sample_data" / "reviews_zh.jsonl").open()]
    chats = [[{"role": "system", "content": "从商品评论中提取一个方面、情感和原文证据，只输出 JSON。"},
              {"role": "user", "content": reviews[i % len(reviews)]}] for i in range(a.rows)]
    llm = LLM(model=a.model, enforce_eager=True, max_model_len=1024, seed=0)
    results = []
    for rep, mode in alternating(("plain", "guided"), a.repeats):
        guided = StructuredOutputsParams(json=schema) if mode == "guided" else None
        params = SamplingParams(max_tokens=a.max_tokens, temperature=0, structured_outputs=guided,
                                ignore_eos=mode == "plain")
        t = time.perf_counter()
        outs = llm.chat(chats, params, use_tqdm=False)
        seconds = time.perf_counter() - t
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        r = {"mode": mode, "repeat": rep, "rows": a.rows, "seconds": round(seconds, 2), "tokens_generated": tokens,
             "tokens_per_second": round(tokens / seconds, 1)}
        print(json.dumps(r), flush=True)
        results.append(r)
    append_jsonl(a.out, *results)
    for mode in ("plain", "guided"):
        xs = [r["tokens_per_second"] for r in results if r["mode"] == mode]
        print(f"{mode:7s} tok/s {spread_text(xs)}; runs {xs}")
    g = [r["tokens_per_second"] for r in results if r["mode"] == "guided"]
    p = [r["tokens_per_second"] for r in results if r["mode"] == "plain"]
    print("guided / plain per repeat:", [round(x / y, 3) for x, y in zip(g, p)])

