"""Two checks of the GPU operator's worker on a real GPU (no Airflow needed on the GPU host):

  stop   start a shard, let it generate, stop it as on_kill does (SIGTERM to the worker's process group, then
         SIGKILL), and measure how soon the GPU memory is back (nvidia-smi)
  resume kill the worker with SIGKILL after its 3rd committed chunk, retry, and check that the shard holds
         every row exactly once; report the time the retry needed and how much it skipped
  leases (a worker with several GPUs) each shard task is a process of its own that runs its shard as the
         operator does (run_shard_isolated: GpuLease → CUDA_VISIBLE_DEVICES → worker): first one task alone,
         then three at once on two GPUs — two run side by side, the third waits for a free GPU. Reports which
         GPU each task got, whether two tasks ever held one GPU, and throughput of two GPUs against one

    python -m bench gpu-checks --model DIR --dummy stop|resume|leases
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from batch_llm.io.storage import Location, iter_jsonl, list_files, write_jsonl
from batch_llm.isolation.shard_process import IsolatedShard, worker_spec
from batch_llm.isolation.worker_parent import WorkerFailed, WorkerHandle
from batch_llm.layout import RunLayout

from bench.inference import make_dataset
from bench.runners import ROOT, bench_command, bench_config, child_env, model_vocab, print_result

# the worker kills itself after its 3rd commit (the listener in tests/fault_injection)
FAULT_ENV = {"BATCH_LLM_FAULT": "after_commit:3", "PYTHONPATH": os.pathsep.join(
    [str(ROOT / "tests" / "fault_injection"), os.environ.get("PYTHONPATH", "")])}


def gpu_used_mib() -> int:
    """Memory in use on the GPUs this check may use ($CUDA_VISIBLE_DEVICES, else all)."""
    mine = os.environ.get("CUDA_VISIBLE_DEVICES")
    out = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True).stdout
    rows = [[x.strip() for x in line.split(",")] for line in out.splitlines() if line.strip()]
    return sum(int(used) for idx, used in rows if mine is None or idx in mine.split(","))


def make_shard(a, n: int, work: Path, seed: int = 0) -> tuple:
    """(config, layout, model reference, shard) of one shard of ``n`` fixed-length rows under ``work``."""
    rows = make_dataset("fixed", n, 256, 256, model_vocab(a.model) - 1, 2048, seed=seed)
    shard_url = str(work / "shard-00000.jsonl")
    write_jsonl(Location(shard_url).path(), ({**r, "idx": i, "messages": []} for i, r in enumerate(rows)))
    cfg = bench_config(a.model, name="gpucheck", label="gpu check", input=shard_url, output=str(work), max_tokens=256,
                       dummy=a.dummy, engine={"max_model_len": 2048, "gpu_memory_utilization": 0.9, "dtype": "bfloat16",
                                              "commit_every_rows": 200, "progress_every_seconds": 5},
                       evaluate={}, filter={})  # their defaults, as before
    layout = RunLayout.for_run(cfg, run_id="check", ds="2026-01-01")
    return cfg, layout, {"local_dir": a.model, "model_key": "check"}, {"index": 0, "rows": n, "url": shard_url}


def make_spec(a, n: int, work: Path, seed: int = 0) -> tuple[dict, Location]:
    cfg, layout, model, shard = make_shard(a, n, work, seed)
    return worker_spec(cfg, layout, model, shard), layout.shard_dir(0)


def check_stop(a) -> dict:
    spec, shard_dir = make_spec(a, 20000, Path(tempfile.mkdtemp()))
    idle = gpu_used_mib()
    h = WorkerHandle.start(spec)
    lines: list[str] = []
    def read_lines(stream) -> None:
        for x in stream:
            lines.append(x)

    threading.Thread(target=read_lines, args=(h.proc.stdout,), daemon=True).start()
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
        WorkerHandle.start(spec, env=FAULT_ENV).wait(on_line=lambda _: None)
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


def lease_task(a) -> None:
    """One shard task, as BatchInferenceOperator.execute runs it (``batch_llm.isolation.shard_process``): lease a GPU, start the
    worker pinned to it, wait for its manifest, release the lease."""
    cfg, layout, model, shard = make_shard(a, a.rows, Path(tempfile.mkdtemp()), seed=a.seed)
    run = IsolatedShard(cfg, layout, model, shard, holder=f"task-{a.seed}", lease_poll=0.5)
    t0 = time.time()
    marks = {}

    def on_line(line: str) -> None:
        if " started in " in line and "gen_start" not in marks:
            marks["gen_start"] = time.time()

    mt = run.run(on_line=on_line).metrics
    t_end = time.time()
    t_lease = t0 + run.lease_wait_seconds
    print_result(dict(task=a.seed, gpu=run.gpus, rows=mt.rows, asked_at=t0, leased_at=t_lease,
                      gen_start=marks.get("gen_start", t_lease), end=t_end, output_tokens=mt.output_tokens,
                      generate_s=mt.generate_seconds, engine_start_s=mt.engine_start_seconds), "TASK ")


def run_tasks(a, rows: list[int], lease_dir: str) -> tuple[list[dict], list[dict]]:
    """Starts one task process per entry of ``rows``, 2 s apart (so the lease order is the list's order)."""
    env = child_env(BATCH_LLM_LEASE_DIR=lease_dir)
    procs = []
    for i, n in enumerate(rows):
        cmd = bench_command("gpu-checks", "--model", a.model, *(["--dummy"] if a.dummy else []), "--rows", n, "--seed", i,
                            "lease-task")
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env))
        time.sleep(2)
    samples: list[dict] = []  # which worker processes hold memory on which GPU, sampled every 0.5 s
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set() and shutil.which("nvidia-smi"):
            out = subprocess.run(["nvidia-smi", "--query-compute-apps=gpu_bus_id,pid", "--format=csv,noheader"],
                                 capture_output=True, text=True).stdout
            per_gpu: dict[str, set[str]] = {}  # GPU → process groups (one per task's worker) using it
            for line in out.splitlines():
                bus, pid = [x.strip() for x in line.split(",")]
                per_gpu.setdefault(bus, set()).add(task_group_of(pid))
            samples.append(per_gpu)
            time.sleep(0.5)

    threading.Thread(target=sample, daemon=True).start()
    results, logs = [], []
    for p in procs:
        out, _ = p.communicate()
        logs.append(out)
        line = next((x for x in out.splitlines() if x.startswith("TASK ")), None)
        if line is None:
            raise RuntimeError("a task failed:\n" + out[-3000:])
        results.append(json.loads(line[5:]))
    stop.set()
    return results, samples


def task_group_of(pid: str) -> str:
    try:
        return str(os.getpgid(int(pid)))
    except (ProcessLookupError, ValueError):
        return "?"


def check_leases(a) -> dict:
    lease_dir = tempfile.mkdtemp(prefix="leases_")
    (one,), _ = run_tasks(a, [a.rows], lease_dir)
    one_tok_s = one["output_tokens"] / (one["end"] - one["gen_start"])
    many, samples = run_tasks(a, [a.rows, a.rows, max(a.rows // 10, 10)], lease_dir)
    first_two, third = many[:2], many[2]
    span = max(t["end"] for t in first_two) - min(t["gen_start"] for t in first_two)
    two_tok_s = sum(t["output_tokens"] for t in first_two) / span
    # Never two tasks on one GPU: the lease intervals of tasks that got the same GPU do not overlap.
    overlaps = [(x["task"], y["task"]) for x in many for y in many if x["task"] < y["task"] and x["gpu"] == y["gpu"]
                and x["leased_at"] < y["end"] and y["leased_at"] < x["end"]]
    sharing = max((len(groups) for s in samples for groups in s.values()), default=0)
    return dict(check="leases", gpus=sorted({t["gpu"] for t in many}),
                tasks=[dict(task=t["task"], gpu=t["gpu"], rows=t["rows"], waited_s=round(t["leased_at"] - t["asked_at"], 1),
                            engine_start_s=round(t["engine_start_s"], 1), generate_s=round(t["generate_s"], 1))
                       for t in many],
                third_task_waited_s=round(third["leased_at"] - third["asked_at"], 1),
                lease_overlaps_on_one_gpu=overlaps, max_workers_seen_on_one_gpu=sharing,
                one_gpu_tok_s=round(one_tok_s), two_gpus_tok_s=round(two_tok_s),
                two_over_one=round(two_tok_s / one_tok_s, 3),
                per_task_tok_s=[round(t["output_tokens"] / t["generate_s"]) for t in first_two],
                two_over_one_sum_of_rates=round(sum(t["output_tokens"] / t["generate_s"] for t in first_two)
                                                / (one["output_tokens"] / one["generate_s"]), 3),
                start_offset_s=round(abs(first_two[0]["gen_start"] - first_two[1]["gen_start"]), 1))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--dummy", action="store_true")
    p.add_argument("--rows", type=int, default=3000, help="rows per shard task (leases)")
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("checks", nargs="+", choices=["stop", "resume", "leases", "lease-task"])
    a = p.parse_args(argv)
    if a.checks == ["lease-task"]:
        return lease_task(a)
    for c in a.checks:
        print_result({"stop": check_stop, "resume": check_resume, "leases": check_leases}[c](a))
