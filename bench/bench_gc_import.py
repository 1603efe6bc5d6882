"""The engine's start with Python's cyclic collector paused over vLLM's import (``gc_paused_import``, the default)
against the same start with the collector running as usual: a fresh process per run, alternating.

    python3 bench/bench_gc_import.py --model /root/work/qwen7b_cfg --dummy --pairs 3 --out $OUT/gc.jsonl  # GPU
    .venv/bin/python bench/bench_gc_import.py --model "$(.venv/bin/python -m batch_llm.demo_model)" --eager \
        --max-model-len 1024 --pairs 3                                                        # CPU, the demo's

Each run: import vLLM (timed alone, under the variant's collector), then the project's engine start
(``batch_llm.engine_start.start_engine``: ``LLM(...)``, the engine core, its warm-up), then 8 short greedy requests
so the engine is shown to serve. ``paused`` is the project as shipped; ``collecting`` replaces the pause by a no-op.
A run prints ``RESULT {json}``: import_s, construct_s (the start after the import), engine_ready_s (process start
-> engine started), served.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

from bench_compile_cache import run_in_own_group  # this folder: the script's own, first on sys.path
from bench_inference import spread

T0 = time.time()
VARIANTS = ("paused", "collecting")


def child(a) -> None:
    import batch_llm.engines.vllm_engine as vllm_engine
    from batch_llm.config import parse_config
    from batch_llm.engine_start import start_engine
    from batch_llm.engines.base import GenRequest

    pause = vllm_engine.gc_paused_import if a.variant == "paused" else contextlib.nullcontext
    vllm_engine.gc_paused_import = pause  # what VllmEngine.start uses
    t = time.perf_counter()
    with pause("vllm"):
        import vllm  # noqa: F401 - timed alone: the start below finds it imported
        from vllm import LLM  # noqa: F401
    import_s = time.perf_counter() - t
    extra = {"load_format": "dummy", "skip_tokenizer_init": True} if a.dummy else {}
    cfg = parse_config({
        "name": "bench", "model": {"ref": a.model}, "input": {"path": "unused.jsonl"}, "output": {"path": "unused"},
        "engine": {"kind": "vllm", "max_model_len": a.max_model_len, "gpu_memory_utilization": a.gpu_util,
                   "enforce_eager": a.eager, "extra": extra},
        "sampling": {"max_tokens": 16, "temperature": 0.0, "seed": 0, "ignore_eos": True},
        "cache": {"enabled": False}, "evaluate": {"enabled": False}, "filter": {"enabled": False}}, "bench")
    engine, info = start_engine(a.model, cfg, lambda m: None)
    ready = time.time() - T0
    reqs = [GenRequest(key=str(i), prompt_token_ids=[100 + i] * 32) for i in range(8)]
    out = list(engine.generate(reqs))
    served = len(out) == 8 and all(r.error is None and r.completion_tokens == 16 for r in out)
    print("RESULT " + json.dumps({"variant": a.variant, "import_s": round(import_s, 2),
                                  "construct_s": round(info.start_seconds, 2), "engine_ready_s": round(ready, 2),
                                  "served": served}), flush=True)
    engine.close()
    os._exit(0)  # the result is out; the parent ends this run's process group (engine core included)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--dummy", action="store_true", help="random weights (load_format=dummy)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--gpu-util", type=float, default=0.90)
    p.add_argument("--eager", action="store_true", help="engine.enforce_eager (the demo's CPU setting)")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--timeout", type=float, default=200)
    p.add_argument("--out")
    p.add_argument("--variant", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.variant:
        return child(a)
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for i in range(a.pairs):
        for variant in VARIANTS if i % 2 == 0 else VARIANTS[::-1]:  # alternating: a drifting machine favours neither
            text, _ = run_in_own_group([sys.executable, __file__, *sys.argv[1:], "--variant", variant], a.timeout)
            line = next((x for x in text.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                print(f"{variant} FAILED\n{text[-3000:]}", flush=True)
                continue
            res = json.loads(line[7:])
            runs[variant].append(res)
            print(json.dumps(res), flush=True)
            if a.out:
                with open(a.out, "a") as f:
                    f.write(json.dumps({"run": res}) + "\n")
    summary = {v: {k: spread([r[k] for r in rs]) for k in ("import_s", "construct_s", "engine_ready_s")}
               for v, rs in runs.items() if rs}
    print("SUMMARY " + json.dumps(summary), flush=True)
    if a.out:
        with open(a.out, "a") as f:
            f.write(json.dumps({"summary": summary}) + "\n")


if __name__ == "__main__":
    main()
