"""The recommend model (``batch_llm/sizing/recommend.py``) against a fresh run on a GPU (measured on an H200).

    python -m bench recommend-check predict --out docs/bench-results/h200-recommend-check-2026-12-01.jsonl   # here, before
    python -m bench recommend-check run --util 0.9 --workloads A,A,C,D --out $OUT/check.jsonl     # on the GPU host

``predict`` writes the model's predictions (phase "prediction") for the workloads below, before any run. ``run``
starts one vLLM engine (random-weight Qwen2.5-7B shape, ``load_format="dummy"``, bf16, max_model_len 2048, the
given gpu_memory_utilization, vLLM's defaults otherwise), a 16-prompt warm-up, then each workload named once per
mention, with fresh random token-id prompts every run (no prefix-cache hits), greedy, ``ignore_eos``; clock: the
``llm.generate`` call. Each measured line carries the prediction (recomputed there with the same code, and the
committed one checked against it) and the error (predicted / measured - 1). The 2026-12-01 lines say
"output_tokens" for the tokens generated in all (the per-row figure of the prediction was overwritten: fixed
since, as "generated_tokens"). Workloads:

    A  512 prompts x 1024 -> 128 tokens (prefill-heavy; the fresh workload)
    C  1000 x 256 -> 256 (the calibration point, re-run on the same machine: that machine's own speed)
    D  64 x 128 -> 512 (few sequences: the weight-streaming regime)
    B  1000 x 256 -> 256 with gpu_memory_utilization 0.2 (the KV cache holds fewer sequences than the batch)
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bench.runners import ROOT, T0, emit, start_vllm

sys.path.insert(0, str(ROOT / "include"))  # a python3 without the project installed
from batch_llm.sizing import recommend as R  # noqa: E402

CONFIG = ROOT / "tests" / "data" / "qwen2.5-7b-config.json"
WORKLOADS = {"A": (512, 1024, 128, 0.9), "C": (1000, 256, 256, 0.9), "D": (64, 128, 512, 0.9),
             "B": (1000, 256, 256, 0.2)}


def prediction(name: str) -> dict:
    rows, p, t, util = WORKLOADS[name]
    shape = R.load_model_shape(CONFIG)
    job = R.Job(rows=rows, prompt_tokens=p, output_tokens=t, gpu_memory_utilization=util)
    plan = R.memory_plan(shape, R.DEVICES["H200"], 1, job)
    seconds, c = R.generation_seconds(shape, R.DEVICES["H200"], 1, job, rows, plan)
    return {"workload": name, "rows": rows, "prompt_tokens": p, "output_tokens": t, "gpu_memory_utilization": util,
            "predicted_output_tok_s": round(rows * t / seconds, 1), "predicted_seconds": round(seconds, 3),
            "predicted_kv_cache_tokens": plan.kv_tokens, "predicted_in_flight": c}


def cmd_predict(a) -> None:
    consts = {k: getattr(R, k) for k in ("ETA_MEMORY", "ETA_COMPUTE", "FP8_COMPUTE", "STAGE_RATE")}
    for name in WORKLOADS:
        emit(a.out, "recommend_check", {"phase": "prediction", **prediction(name), "constants": consts})


def cmd_run(a) -> None:
    import numpy as np
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    committed = {}
    if a.predictions and Path(a.predictions).exists():
        for line in open(a.predictions, encoding="utf-8"):
            r = json.loads(line)
            if r.get("phase") == "prediction":
                committed[r["workload"]] = r
    llm, info = start_vllm(a.model, skip_tokenizer_init=True, gpu_memory_utilization=a.util)
    kv = info["kv_cache_tokens"]
    emit(a.out, "recommend_check", {"phase": "engine", **{k: info[k] for k in ("vllm", "gpu")},
                                    "gpu_memory_utilization": a.util,
                                    **{k: info[k] for k in ("import_s", "construct_s", "kv_cache_tokens", "max_num_seqs",
                                                            "max_num_batched_tokens")}})
    rng = np.random.default_rng(1234)
    greedy = dict(temperature=0.0, ignore_eos=True, detokenize=False)
    llm.generate([TokensPrompt(prompt_token_ids=rng.integers(0, 150000, 64).tolist()) for _ in range(16)],
                 SamplingParams(max_tokens=16, **greedy), use_tqdm=False)
    for i, name in enumerate(a.workloads.split(",")):
        if time.time() - T0 > a.budget_s:
            emit(a.out, "recommend_check", {"phase": "skipped", "workload": name, "why": f"past --budget-s {a.budget_s}"})
            continue
        rows, p, t, util = WORKLOADS[name]
        if util != a.util:
            raise SystemExit(f"workload {name} wants gpu_memory_utilization {util}, this engine has {a.util}")
        pred = prediction(name)
        same = committed.get(name, {}).get("predicted_output_tok_s") == pred["predicted_output_tok_s"]
        prompts = [TokensPrompt(prompt_token_ids=rng.integers(0, 150000, p).tolist()) for _ in range(rows)]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(max_tokens=t, **greedy), use_tqdm=False)
        seconds = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        rate = tokens / seconds
        emit(a.out, "recommend_check", {"phase": "measured", "run": i, **pred, "prediction_as_committed": same,
                     "seconds": round(seconds, 3), "generated_tokens": tokens, "output_tok_s": round(rate, 1),
                     "kv_cache_tokens": kv, "error": round(pred["predicted_output_tok_s"] / rate - 1, 4),
                     "kv_error": round(pred["predicted_kv_cache_tokens"] / kv - 1, 4)})


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("predict")
    p.add_argument("--out", required=True)
    r = sub.add_parser("run")
    r.add_argument("--model", default="/root/work/qwen7b_cfg")
    r.add_argument("--util", type=float, default=0.9)
    r.add_argument("--workloads", default="A,A,C,D")
    r.add_argument("--predictions", default=str(ROOT / "docs" / "bench-results" / "h200-recommend-check-2026-12-01.jsonl"))
    r.add_argument("--budget-s", type=float, default=400.0, help="skip workloads once the process is this old")
    r.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    {"predict": cmd_predict, "run": cmd_run}[a.cmd](a)

