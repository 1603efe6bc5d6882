"""Two checks of the GPU operator's worker on a real GPU (run on the lent H200; no Airflow needed there):

  stop   start a shard, let it generate, stop it as on_kill does (SIGTERM to the worker's process group, then
         SIGKILL), and measure how soon the GPU memory is back (nvidia-smi)
  resume kill the worker with SIGKILL after its 3rd committed chunk, retry, and check that the shard holds
         every row exactly once; report the time the retry needed and how much it skipped

    python bench/gpu_checks.py --model DIR --dummy stop|resume
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_inference import make_dataset  # noqa: E402

from batch_llm.config import parse_config  # noqa: E402
from batch_llm.stages import RunLayout  # noqa: E402
from batch_llm.storage import Location, iter_jsonl, list_files, write_jsonl  # noqa: E402
from batch_llm.worker import WorkerFailed, WorkerHandle  # noqa: E402


def gpu_used_mib() -> int:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True).stdout
    return sum(int(x) for x in out.split())


def make_spec(a, n: int, work: Path) -> tuple[dict, Location]:
    cfgjson = json.load(open(Path(a.model) / "config.json"))
    rows = make_dataset("fixed", n, 256, 256, min(cfgjson.get("vocab_size", 32000), 150000) - 1, 2048)
    shard_url = str(work / "shard-00000.jsonl")
    write_jsonl(Location(shard_url).path(), ({**r, "idx": i, "messages": []} for i, r in enumerate(rows)))
    extra = {"load_format": "dummy", "skip_tokenizer_init": True} if a.dummy else {}
    cfg = parse_config({
        "name": "gpucheck", "model": {"ref": a.model}, "input": {"path": shard_url}, "output": {"path": str(work)},
        "engine": {"kind": "vllm", "max_model_len": 2048, "gpu_memory_utilization": 0.9, "dtype": "bfloat16",
                   "extra": extra, "commit_every_rows": 200, "progress_every_seconds": 5},
        "sampling": {"max_tokens": 256, "temperature": 0.0, "seed": 0, "ignore_eos": True},
        "cache": {"enabled": False}}, "gpu check")
    layout = RunLayout.for_run(cfg, run_id="check", ds="2026-01-01")
    spec = {"config": cfg.model_dump(mode="json"), "layout": layout.to_dict(),
            "model": {"local_dir": a.model, "model_key": "check"}, "shard": {"index": 0, "rows": n, "url": shard_url}}
    return spec, layout.stage("infer").child("shard-00000")


def check_stop(a) -> dict:
    spec, shard_dir = make_spec(a, 20000, Path(tempfile.mkdtemp()))
    idle = gpu_used_mib()
    h = WorkerHandle.start(spec)
    lines: list[str] = []
    import threading

    threading.Thread(target=lambda: [lines.append(x) for x in h.proc.stdout], daemon=True).start()
    while not any("progress:" in x for x in lines):
        if h.proc.poll() is not None:
            raise RuntimeError("worker ended early:\n" + "\n".join(lines[-30:]))
        time.sleep(0.5)
    busy = gpu_used_mib()
    t0 = time.perf_counter()
    h.stop(grace_seconds=10)
    t_stopped = time.perf_counter() - t0
    while gpu_used_mib() > idle + 512:
        time.sleep(0.05)
    t_free = time.perf_counter() - t0
    return dict(check="stop", idle_mib=idle, busy_mib=busy, after_mib=gpu_used_mib(),
                group_ended_s=round(t_stopped, 2), memory_free_s=round(t_free, 2),
                chunks_committed=len(list_files(shard_dir.child("chunks").path(), ".jsonl")))


def check_resume(a) -> dict:
    spec, shard_dir = make_spec(a, 3000, Path(tempfile.mkdtemp()))
    t0 = time.perf_counter()
    try:
        WorkerHandle.start(spec, env={"BATCH_LLM_FAULT": "after_commit:3"}).wait(on_line=lambda _: None)
        raise AssertionError("the fault did not fire")
    except WorkerFailed as e:
        crashed = str(e)[:80]
    t_crash = time.perf_counter() - t0
    committed = sum(1 for f in list_files(shard_dir.child("chunks").path(), ".jsonl") for _ in iter_jsonl(f))
    t1 = time.perf_counter()
    m = WorkerHandle.start(spec).wait(on_line=lambda _: None)
    t_retry = time.perf_counter() - t1
    ids = [r["id"] for f in list_files(shard_dir.child("chunks").path(), ".jsonl") for r in iter_jsonl(f)]
    out = [r["id"] for r in iter_jsonl(shard_dir.child("outputs.jsonl").path())]
    return dict(check="resume", crashed=crashed, first_attempt_s=round(t_crash, 1), committed_before_crash=committed,
                retry_s=round(t_retry, 1), rows=len(out), unique=len(set(out)), chunk_rows=len(ids),
                exactly_once=len(ids) == len(set(ids)) == len(out) == 3000,
                retry_generated_tokens=m["metrics"]["output_tokens_this_attempt"],
                retry_engine_start_s=m["metrics"]["engine_start_seconds"])


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--dummy", action="store_true")
    p.add_argument("checks", nargs="+", choices=["stop", "resume"])
    a = p.parse_args()
    for c in a.checks:
        print("RESULT " + json.dumps({"stop": check_stop, "resume": check_resume}[c](a)), flush=True)
