"""The OpenAI Batch API's overhead: one OpenAI Batch file through the API (upload → batches.create → poll →
``completed``, real Airflow services: api-server, scheduler, dag-processor, LocalExecutor) against the same file
through ``batch-llm run-batch`` (one process), both on the CPU vLLM engine with the demo model.

The pipeline behind the API is run-batch's own: one shard, no content filter, no scoring, no result cache, the same
engine settings. Each line sets its own ``max_tokens`` and ``temperature: 0``, so both sides generate the same
tokens. Reported: both wall times, the API's overhead, and where the API's time went: the batch's own timestamps
(``created_at`` → ``in_progress_at`` → ``finalizing_at`` → ``completed_at``) and the scheduler's latencies read
from the task instances (each task's wait from the previous task's end, or the run's start, to its own start),
beside the shard's engine start and generation from its manifest.

    python -m bench openai-batch-api --rows 1000 --max-tokens 16 --repeats 3 --out bench/results/openai_batch_api.jsonl
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.runners import ROOT, cpu_env, emit

MODEL = "demo-model"


def _requests(path: Path, rows: int, max_tokens: int) -> None:
    """``rows`` chat requests of the demo's prompts, each made unique (no line repeats another's prompt)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from airflow_services import valid_sample_rows

    base = [r for r in valid_sample_rows() if r.get("prompt") or r.get("messages")]
    with open(path, "w", encoding="utf-8") as f:
        for i in range(rows):
            r = base[i % len(base)]
            messages = r.get("messages") or [{"role": "user", "content": r["prompt"]}]
            messages = [*messages[:-1], {**messages[-1], "content": f"{messages[-1]['content']} (#{i})"}]
            f.write(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": {"model": MODEL, "messages": messages, "max_tokens": max_tokens,
                                         "temperature": 0}}) + "\n")


def _run_batch(inp: Path, out: Path, model_dir: Path) -> float:
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "batch_llm", "run-batch", "-i", str(inp), "-o", str(out), "--model",
                        str(model_dir), "--max-model-len", "1024", "--enforce-eager", "--plain"],
                       env=cpu_env(), capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode:
        raise SystemExit(f"run-batch failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return wall


def _pipeline(tmp: Path, model_dir: Path) -> Path:
    import yaml

    folder = tmp / "pipelines"
    folder.mkdir(parents=True)
    cfg = {"name": "openai_batch_bench", "model": {"ref": str(model_dir)},
           "input": {"path": str(tmp / "unused.jsonl"), "format": "openai_batch", "sampling_columns": []},
           "sharding": {"num_shards": 1}, "filter": {"enabled": False}, "evaluate": {"enabled": False},
           "cache": {"enabled": False}, "engine": {"kind": "vllm", "max_model_len": 1024, "enforce_eager": True,
                                                   "max_error_rate": 1.0, "reasoning_parser": None},
           "output": {"path": str(tmp / "out")}, "openai_batch": {"models": [MODEL]},
           "airflow": {"schedule": None, "retries": 0, "start_date": "2026-01-01"}}
    (folder / "openai_batch_bench.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return folder


def _ts(value: str | None) -> float | None:
    return dt.datetime.fromisoformat(value).timestamp() if value else None


def _gap(later: float | None, earlier: float | None) -> float | None:
    return round(later - earlier, 2) if later is not None and earlier is not None else None


def _scheduler_latencies(svc, dag_id: str, run_id: str) -> dict[str, Any]:
    """Per task (in start order): its wait from its upstream's end (or the run's start) to its own start, and
    its own run time; and the waits' sum."""
    run = svc.api("GET", f"dags/{dag_id}/dagRuns/{run_id}")
    tis = sorted(svc.task_instances(dag_id, run_id), key=lambda t: t["start_date"] or "")
    upstream = {"quantize": "fetch_model", "filter_shard": "batch_inference", "content_filter": "filter_shard",
                "evaluate": "content_filter", "publish": "evaluate"}
    ends: dict[str, float] = {}
    for t in tis:
        name, end = t["task_id"].rsplit(".", 1)[-1], _ts(t["end_date"])
        if end is not None:
            ends[name] = max(ends.get(name, end), end)
    run_start = _ts(run["start_date"])
    out: dict[str, Any] = {}
    for t in tis:
        name = t["task_id"].rsplit(".", 1)[-1]
        if name == "batch_inference":  # waits for the model and the plan
            ready: float | None = max(ends.get("quantize", 0.0), ends.get("plan_shards", 0.0)) or None
        else:
            ready = ends.get(upstream[name]) if name in upstream else run_start
        start, end = _ts(t["start_date"]), _ts(t["end_date"])
        out[name] = {"wait_s": _gap(start, ready), "run_s": _gap(end, start)}
    out["total_wait_s"] = round(sum(v["wait_s"] or 0.0 for v in out.values()), 2)
    out["run_queued_to_start_s"] = _gap(run_start, _ts(run.get("queued_at")))
    return out


def _through_api(inp: Path, tmp: Path, model_dir: Path) -> dict:
    import openai

    sys.path.insert(0, str(ROOT / "tests"))
    from airflow_services import AirflowServices

    env = {k: v for k, v in cpu_env().items() if not k.startswith("AIRFLOW")}  # the services' Airflow is their own
    svc = AirflowServices(tmp, pipelines_dir=_pipeline(tmp, model_dir), extra_env=env, pools={"gpu": 1})
    try:
        svc.start()
        svc.wait_dag_parsed("openai_batch_bench")
        svc.unpause("openai_batch_bench")
        c = openai.OpenAI(base_url=f"{svc.base_url}/openai/v1", api_key=svc.token(), max_retries=5)
        t0 = time.time()
        f = c.files.create(file=open(inp, "rb"), purpose="batch")
        t_uploaded = time.time()
        b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        while b.status not in ("completed", "failed", "expired", "cancelled"):
            time.sleep(0.5)
            b = c.batches.retrieve(b.id)
        t_done = time.time()
        if b.status != "completed":
            raise SystemExit(f"batch {b.status}: {b.errors}\n{svc.describe_run('openai_batch_bench', b.id)}")
        assert b.output_file_id is not None and b.request_counts is not None
        assert b.in_progress_at is not None and b.finalizing_at is not None and b.completed_at is not None
        out = c.files.content(b.output_file_id).text
        t_downloaded = time.time()
        shard = next((tmp / "out").rglob("shard-00000/manifest.json"))
        metrics = json.loads(shard.read_text())["metrics"]
        return {"wall_s": round(t_done - t0, 2), "upload_s": round(t_uploaded - t0, 2),
                "download_s": round(t_downloaded - t_done, 2), "lines_out": len(out.splitlines()),
                "batch": {k: getattr(b, k) for k in ("created_at", "in_progress_at", "finalizing_at", "completed_at")},
                "request_counts": b.request_counts.model_dump(),
                "validating_s": b.in_progress_at - b.created_at, "in_progress_s": b.finalizing_at - b.in_progress_at,
                "finalizing_s": b.completed_at - b.finalizing_at,
                "engine_start_s": metrics.get("engine_start_seconds"), "generate_s": metrics.get("generate_seconds"),
                "scheduler": _scheduler_latencies(svc, "openai_batch_bench", b.id)}
    finally:
        svc.stop()


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench openai-batch-api", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--out", default=None, help="append the result as a JSON line here")
    ap.add_argument("--repeats", type=int, default=3, help="alternating runs of each side (run-batch first, then "
                    "the API first, ...); each pair is one line")
    args = ap.parse_args(argv)
    from batch_llm.demo_model import build_demo_model

    model_dir = build_demo_model()
    for r in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="bench-openai-batch-") as tmp_s:
            tmp = Path(tmp_s)
            inp = tmp / "requests.jsonl"
            _requests(inp, args.rows, args.max_tokens)
            if r % 2 == 0:
                direct = _run_batch(inp, tmp / "run_batch_out.jsonl", model_dir)
                api = _through_api(inp, tmp / "api", model_dir)
            else:
                api = _through_api(inp, tmp / "api", model_dir)
                direct = _run_batch(inp, tmp / "run_batch_out.jsonl", model_dir)
        emit(args.out, "openai-batch-api", {"rows": args.rows, "max_tokens": args.max_tokens, "engine": "vllm (CPU)",
                                            "repeat": r, "first": "run-batch" if r % 2 == 0 else "api",
                                            "run_batch_wall_s": round(direct, 2), "api": api,
                                            "api_overhead_s": round(api["wall_s"] - direct, 2),
                                            "api_over_run_batch": round(api["wall_s"] / direct, 3)})
    return 0
