"""engine.compile_cache, cold vs warm: the project's engine start (``batch_llm.engine_start.start_engine``) in a
fresh process per run, alternating cold (an empty store) and warm (the store the previous cold run filled).

The cache goes through the object-storage path (``file://`` store: archive unpacked into a fresh worker-local
folder before the start, packed and uploaded after), so a warm run pays the download and a cold run the upload,
as a worker on a new machine would. Each run's worker-local folder is new, so no run sees another's files
except through the archive.

    python3 bench/bench_compile_cache.py --model /root/work/qwen7b_cfg --dummy --pairs 3 --out $OUT/cc.jsonl

A run prints ``RESULT {json}``: engine_ready_s (process start -> engine started, cache download included,
upload not), upload_s, wall_s (process start -> exit, after generating a few tokens), the cache record.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

T0 = time.time()


def child(a) -> None:
    os.environ["BATCH_LLM_COMPILE_CACHE_LOCAL"] = a.local  # before compile_cache reads it
    from batch_llm.config import parse_config
    from batch_llm.engine_start import start_engine
    from batch_llm.engines.base import GenRequest

    extra = {"load_format": "dummy", "skip_tokenizer_init": True} if a.dummy else {}
    cfg = parse_config({
        "name": "bench", "model": {"ref": a.model}, "input": {"path": "unused.jsonl"}, "output": {"path": a.local},
        "engine": {"kind": "vllm", "max_model_len": a.max_model_len, "gpu_memory_utilization": a.gpu_util,
                   "compile_cache": a.store, "extra": extra, "enforce_eager": a.eager},
        "sampling": {"max_tokens": 16, "temperature": 0.0, "seed": 0, "ignore_eos": True},
        "cache": {"enabled": False}, "evaluate": {"enabled": False}, "filter": {"enabled": False}}, "bench")
    engine, info = start_engine(a.model, cfg, lambda m: print("  [engine]", m[:300], flush=True))
    cc = info.settings["compile_cache"]
    ready = time.time() - T0 - (cc.get("upload_seconds") or 0)
    reqs = [GenRequest(key=str(i), prompt_token_ids=[100 + i] * 32) for i in range(8)]
    try:  # the engine serves: a few greedy tokens (a failure here is reported, the start times still count)
        out = list(engine.generate(reqs))
        served = len(out) == 8 and all(r.error is None and r.completion_tokens == 16 for r in out)
    except Exception as e:  # noqa: BLE001 - reported in the result
        served = f"{type(e).__name__}: {e}"
    print("RESULT " + json.dumps({"mode": a.mode, "engine_ready_s": round(ready, 2),
                                  "engine_construct_s": round(info.start_seconds, 2),
                                  "upload_s": cc.get("upload_seconds"), "download_s": cc.get("download_seconds"),
                                  "hit": cc["hit"], "files_before": cc["files_before"],
                                  "files_after": cc["files_after"], "archive_mb": _mb(cc.get("archive")),
                                  "warnings": cc["warnings"], "served": served,
                                  "wall_s": round(time.time() - T0, 2)}), flush=True)
    engine.close()
    os._exit(0)  # the result is out; the parent ends this run's process group (engine core included)


def _mb(url: str | None) -> float | None:
    p = Path(url.removeprefix("file://")) if url else None
    return round(p.stat().st_size / 2**20, 1) if p and p.exists() else None


def run_in_own_group(cmd: list[str], timeout: float) -> tuple[str, int]:
    """One run in a process group of its own, ended whole afterwards: no engine core outlives its run and
    holds GPU memory into the next."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        text, _ = proc.communicate()
        rc = 124
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    time.sleep(2)  # the GPU memory of the killed group is freed
    return text or "", rc


def main() -> None:
    p = argparse.ArgumentParser()
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
    a = p.parse_args()
    if a.child:
        return child(a)
    work = Path(tempfile.mkdtemp(prefix="cc_bench_"))
    runs: list[dict] = []
    for i in range(a.pairs):
        store = f"file://{work / f'store-{i}'}"  # cold: a new, empty store; warm: the one cold just filled
        for mode in ("cold", "warm"):
            cmd = [sys.executable, __file__, "--child", "--model", a.model, "--mode", mode, "--store", store,
                   "--local", str(work / f"local-{i}-{mode}"), "--max-model-len", str(a.max_model_len),
                   "--gpu-util", str(a.gpu_util)] + (["--dummy"] if a.dummy else []) + (["--eager"] if a.eager else [])
            t0 = time.time()
            text, rc = run_in_own_group(cmd, a.timeout)
            Path(f"{Path(a.out).with_suffix('')}-run-{i}-{mode}.log").write_text(text)  # raw, beside the results
            res = next((json.loads(line[7:]) for line in text.splitlines() if line.startswith("RESULT ")), None)
            if res is None:
                print(f"run {i} {mode}: rc={rc}, no result; tail:\n" + "\n".join(text.splitlines()[-25:]), flush=True)
                res = {"mode": mode, "rc": rc}
            res.update(pair=i, outer_wall_s=round(time.time() - t0, 2))
            for line in text.splitlines():
                if "torch.compile" in line or "Compiling a graph" in line or "init engine" in line \
                        or "compile cache" in line or "Directly load" in line or "graph capturing" in line.lower():
                    print(f"  {i} {mode} | {line[:260]}", flush=True)
            print("RUN " + json.dumps(res), flush=True)
            runs.append(res)
            with open(a.out, "a") as f:
                f.write(json.dumps(res) + "\n")
    summary = {}
    for mode in ("cold", "warm"):
        rs = [r for r in runs if r["mode"] == mode and "engine_ready_s" in r]
        summary[mode] = {k: {"median": round(statistics.median(v), 2), "min": min(v), "max": max(v), "n": len(v)}
                         for k in ("engine_ready_s", "engine_construct_s", "wall_s", "upload_s", "download_s")
                         if (v := [r[k] for r in rs if r.get(k) is not None])}
    print("SUMMARY " + json.dumps(summary), flush=True)
    with open(a.out, "a") as f:
        f.write(json.dumps({"summary": summary}) + "\n")


if __name__ == "__main__":
    main()
