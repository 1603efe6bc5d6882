"""A day of tiny rows through the pipeline's DAG under a real scheduler (api-server, scheduler, dag-processor,
LocalExecutor on SQLite, through the REST API), its engine taken out: every shard worker serves with the echo
engine of the tests (``BATCH_LLM_ECHO_ENGINE``, tests/fault_injection/sitecustomize.py), so what runs is the
pipeline's own work — the plan in parts, the shard runner's request building, commits and merge, the filter per
shard, the publish from parts — on the demo model's tokenizer.

The day: ``--files`` JSONL files of tiny prompt rows (``bench/mapped_steps.make_input``, one id in 10,000 repeated
across files), planned one file a part, ``--rows-per-shard`` rows a shard, ``output.parts``. Reported: the run's
wall time, every task's run time (the largest of each step and their sum), the published rows against the input's
valid ones, and the disk the run took at its peak (sampled every 5 s).

    python -m bench dag-day --rows 10000000 --files 20 --rows-per-shard 500000 --out bench/results/dag-day.jsonl
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench.runners import ROOT, cpu_env, emit

DAG_ID = "dag_day"


def _pipeline(tmp: Path, model_dir: Path, rows_per_shard: int, part_bytes: int) -> Path:
    import yaml

    folder = tmp / "pipelines"
    folder.mkdir(parents=True)
    cfg = {"name": DAG_ID, "model": {"ref": str(model_dir)},
           "input": {"path": str(tmp / "in" / "dt={ds}"), "format": "jsonl"},
           "sharding": {"rows_per_shard": rows_per_shard, "plan_part_bytes": part_bytes},
           "sampling": {"max_tokens": 8},
           "filter": {"lists": [{"name": "secrets", "path": "builtin:en", "action": "drop"}]},
           "evaluate": {"enabled": False}, "cache": {"enabled": False},
           "engine": {"kind": "vllm", "max_model_len": 1024, "enforce_eager": True, "max_error_rate": 0.01},
           "output": {"path": str(tmp / "out"), "parts": True},
           "airflow": {"schedule": None, "retries": 0, "start_date": "2026-01-01"}}
    (folder / f"{DAG_ID}.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return folder


def _ts(value: str | None) -> float | None:
    return dt.datetime.fromisoformat(value).timestamp() if value else None


def run(rows: int, files: int, rows_per_shard: int, base: Path) -> dict:
    sys.path.insert(0, str(ROOT / "tests"))
    from airflow_services import AirflowServices
    from batch_llm.demo_model import build_demo_model
    from batch_llm.io.storage import Location, read_json

    from bench.mapped_steps import make_input

    day = dt.date(2026, 12, 1)
    tmp = base / f"dag-day-{rows}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    size = make_input(tmp / "in" / f"dt={day}", rows, files)
    part_bytes = max(f.stat().st_size for f in (tmp / "in" / f"dt={day}").iterdir())
    env = {k: v for k, v in cpu_env().items() if not k.startswith("AIRFLOW")}
    env.update({"PYTHONPATH": str(ROOT / "tests" / "fault_injection"), "BATCH_LLM_ECHO_ENGINE": "1",
                "AIRFLOW__CORE__MAX_MAP_LENGTH": "4096"})
    svc = AirflowServices(tmp, pipelines_dir=_pipeline(tmp, build_demo_model(), rows_per_shard, part_bytes),
                          extra_env=env, pools={"gpu": 2})
    base_used = peak = shutil.disk_usage(tmp).used  # the file system's: the day's growth is reported
    try:
        svc.start()
        svc.wait_dag_parsed(DAG_ID)
        svc.unpause(DAG_ID)
        t0 = time.time()
        run_id = svc.trigger(DAG_ID, logical_date=f"{day}T00:00:00+00:00")["dag_run_id"]
        while True:
            state = svc.api("GET", f"dags/{DAG_ID}/dagRuns/{run_id}")["state"]
            peak = max(peak, shutil.disk_usage(tmp).used)
            if state in ("success", "failed"):
                break
            time.sleep(5)
        wall = time.time() - t0
        tis = svc.task_instances(DAG_ID, run_id)
        if state != "success":
            raise SystemExit(f"run {state}:\n{svc.describe_run(DAG_ID, run_id)}")
        steps: dict[str, dict] = {}
        for t in tis:
            name = t["task_id"].rsplit(".", 1)[-1]
            s = steps.setdefault(name, {"tasks": 0, "largest_task_s": 0.0, "task_seconds": 0.0})
            took = (_ts(t["end_date"]) or 0) - (_ts(t["start_date"]) or 0)
            s["tasks"] += 1
            s["largest_task_s"] = round(max(s["largest_task_s"], took), 2)
            s["task_seconds"] = round(s["task_seconds"] + took, 1)
        part = Location(str(tmp / "out")).child(DAG_ID, f"dt={day}")
        summary = read_json(Location(read_json(part.child("_CURRENT.json").path())["version"]).child(
            "summary.json").path())
        plan = next((tmp / "out").rglob("plan/manifest.json"))
        plan_m = json.loads(plan.read_text())
        return {"rows": rows, "files": files, "rows_per_shard": rows_per_shard, "input_bytes": size,
                "wall_s": round(wall, 1), "valid": plan_m["valid"], "duplicates": plan_m["duplicates"],
                "shards": len(plan_m["shards"]), "rows_published": summary.get("rows_published"),
                "summary_counts": {k: v for k, v in summary.items() if isinstance(v, int)},
                "peak_disk_growth_gb": round((peak - base_used) / 1e9, 1), "steps": steps}
    finally:
        svc.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench dag-day", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--files", type=int, default=20)
    ap.add_argument("--rows-per-shard", type=int, default=500_000)
    ap.add_argument("--dir", default=None, help="work folder (default: a temporary one)")
    ap.add_argument("--out", default=None, help="append the result as a JSON line here")
    a = ap.parse_args(argv)
    base = Path(a.dir or tempfile.mkdtemp(prefix="batch_llm_dag_day_"))
    res = run(a.rows, a.files, a.rows_per_shard, base)
    emit(a.out, "dag-day", res)
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
