"""engine.compile_cache, cold vs warm: the project's engine start (``batch_llm.engines.start.start_engine``) in a
fresh process per run, alternating cold (an empty store) and warm (the store the previous cold run filled).

The cache goes through the object-storage path (``file://`` store: archive unpacked into a fresh worker-local
folder before the start, packed and uploaded after), so a warm run pays the download and a cold run the upload,
as a worker on a new machine would. Each run's worker-local folder is new, so no run sees another's files
except through the archive.

    python3 -m bench compile-cache --model /root/work/qwen7b_cfg --dummy --pairs 3 --out $OUT/cc.jsonl

A run prints ``RESULT {json}``: engine_ready_s (process start -> engine started, cache download included,
upload not), upload_s, wall_s (process start -> exit, after generating a few tokens), the cache record.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from bench.runners import T0, append_jsonl, bench_command, bench_config, child_env, print_result, run, serves, spread


def child(a) -> None:
    os.environ["BATCH_LLM_COMPILE_CACHE_LOCAL"] = a.local  # before compile_cache reads it
    from batch_llm.engines.start import start_engine

    cfg = bench_config(a.model, output=a.local, max_tokens=16, dummy=a.dummy,
                       engine={"max_model_len": a.max_model_len, "gpu_memory_utilization": a.gpu_util,
                               "compile_cache": a.store, "enforce_eager": a.eager})
    engine, info = start_engine(a.model, cfg, lambda m: print("  [engine]", m[:300], flush=True))
    cc = info.settings["compile_cache"]
    ready = time.time() - T0 - (cc.get("upload_seconds") or 0)
    try:  # the engine serves: a few greedy tokens (a failure here is reported, the start times still count)
        served: bool | str = serves(engine)
    except Exception as e:  # noqa: BLE001 - reported in the result
        served = f"{type(e).__name__}: {e}"
    print_result({"mode": a.mode, "engine_ready_s": round(ready, 2),
                                  "engine_construct_s": round(info.start_seconds, 2),
                                  "upload_s": cc.get("upload_seconds"), "download_s": cc.get("download_seconds"),
                                  "hit": cc["hit"], "files_before": cc["files_before"],
                                  "files_after": cc["files_after"], "archive_mb": _mb(cc.get("archive")),
                                  "warnings": cc["warnings"], "served": served,
                  "wall_s": round(time.time() - T0, 2)})
    engine.close()
    os._exit(0)  # the result is out; the parent ends this run's process group (engine core included)


def _mb(url: str | None) -> float | None:
    p = Path(url.removeprefix("file://")) if url else None
    return round(p.stat().st_size / 2**20, 1) if p and p.exists() else None


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--dummy", action="store_true")
    p.add_argument("--eager", action="store_true", help="no compilation (a smoke test of this script on the CPU)")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--gpu-util", type=float, default=0.9)
    p.add_argument("--timeout", type=int, default=170)
    p.add_argument("--out", default="compile_cache.jsonl")
    p.add_argument("--child", action="store_true")
    p.add_argument("--mode", default="cold")
    p.add_argument("--store", default="")
    p.add_argument("--local", default="")
    a = p.parse_args(argv)
    if a.child:
        return child(a)
    work = Path(tempfile.mkdtemp(prefix="cc_bench_"))
    runs: list[dict] = []
    for i in range(a.pairs):
        store = f"file://{work / f'store-{i}'}"  # cold: a new, empty store; warm: the one cold just filled
        for mode in ("cold", "warm"):
            cmd = bench_command("compile-cache", "--child", "--model", a.model, "--mode", mode, "--store", store,
                                "--local", work / f"local-{i}-{mode}", "--max-model-len", a.max_model_len,
                                "--gpu-util", a.gpu_util, *(["--dummy"] if a.dummy else []),
                                *(["--eager"] if a.eager else []))
            proc = run(cmd, env=child_env(), timeout=a.timeout, settle=2)  # settle: the GPU memory is freed
            text = proc.out
            Path(f"{Path(a.out).with_suffix('')}-run-{i}-{mode}.log").write_text(text)  # raw, beside the results
            res = proc.result()
            if res is None:
                print(f"run {i} {mode}: rc={proc.rc}, no result; tail:\n" + "\n".join(text.splitlines()[-25:]),
                      flush=True)
                res = {"mode": mode, "rc": proc.rc}
            res.update(pair=i, outer_wall_s=round(time.time() - proc.started, 2))  # the settle included
            for line in text.splitlines():
                if "torch.compile" in line or "Compiling a graph" in line or "init engine" in line \
                        or "compile cache" in line or "Directly load" in line or "graph capturing" in line.lower():
                    print(f"  {i} {mode} | {line[:260]}", flush=True)
            print_result(res, "RUN ")
            runs.append(res)
            append_jsonl(a.out, res)
    summary = {}
    for mode in ("cold", "warm"):
        rs = [r for r in runs if r["mode"] == mode and "engine_ready_s" in r]
        summary[mode] = {k: spread(v, digits=2)
                         for k in ("engine_ready_s", "engine_construct_s", "wall_s", "upload_s", "download_s")
                         if (v := [r[k] for r in rs if r.get(k) is not None])}
    print_result(summary, "SUMMARY ")
    append_jsonl(a.out, {"summary": summary})
