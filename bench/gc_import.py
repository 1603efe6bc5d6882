"""The engine's start with Python's cyclic collector paused over vLLM's import (``gc_paused_import``, the default)
against the same start with the collector running as usual: a fresh process per run, alternating.

    python3 -m bench gc-import --model /root/work/qwen7b_cfg --dummy --pairs 3 --out $OUT/gc.jsonl  # GPU
    .venv/bin/python -m bench gc-import --model "$(.venv/bin/python -m batch_llm.demo_model)" --eager \
        --max-model-len 1024 --pairs 3                                                   # CPU, the demo's

Each run: import vLLM (timed alone, under the variant's collector), then the project's engine start
(``batch_llm.engines.start.start_engine``: ``LLM(...)``, the engine core, its warm-up), then 8 short greedy requests
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
from collections.abc import Iterator

from bench.runners import T0, alternating, append_jsonl, bench_command, bench_config, child_env, print_result, run, serves, spread

VARIANTS = ("paused", "collecting")


@contextlib.contextmanager
def _collector_running(module: str) -> Iterator[None]:
    """The import as it is without the pause: the collector left running."""
    yield


def child(a) -> None:
    import batch_llm.engines.vllm_engine as vllm_engine
    from batch_llm.engines.start import start_engine

    pause = vllm_engine.gc_paused_import if a.variant == "paused" else _collector_running
    vllm_engine.gc_paused_import = pause  # what VllmEngine.start uses
    t = time.perf_counter()
    with pause("vllm"):
        import vllm  # noqa: F401 - timed alone: the start below finds it imported
        from vllm import LLM  # noqa: F401
    import_s = time.perf_counter() - t
    cfg = bench_config(a.model, max_tokens=16, dummy=a.dummy, engine={
        "max_model_len": a.max_model_len, "gpu_memory_utilization": a.gpu_util, "enforce_eager": a.eager})
    engine, info = start_engine(a.model, cfg, lambda m: None)
    ready = time.time() - T0
    print_result({"variant": a.variant, "import_s": round(import_s, 2), "construct_s": round(info.start_seconds, 2),
                  "engine_ready_s": round(ready, 2), "served": serves(engine)})
    engine.close()
    os._exit(0)  # the result is out; the parent ends this run's process group (engine core included)


def main(argv: list[str] | None = None) -> None:
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
    argv = sys.argv[1:] if argv is None else argv
    a = p.parse_args(argv)
    if a.variant:
        return child(a)
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for _, variant in alternating(VARIANTS, a.pairs):
        proc = run(bench_command("gc-import", *argv, "--variant", variant), env=child_env(), timeout=a.timeout, settle=2)
        res = proc.result()
        if res is None:
            print(f"{variant} FAILED\n{proc.out[-3000:]}", flush=True)
            continue
        runs[variant].append(res)
        print(json.dumps(res), flush=True)
        append_jsonl(a.out, {"run": res})
    summary = {v: {k: spread([r[k] for r in rs]) for k in ("import_s", "construct_s", "engine_ready_s")}
               for v, rs in runs.items() if rs}
    print_result(summary, "SUMMARY ")
    append_jsonl(a.out, {"summary": summary})
