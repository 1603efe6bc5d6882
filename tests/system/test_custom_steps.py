"""The pipeline as a task group inside a DAG of the user's own: redaction before, post-processing after."""
from __future__ import annotations

import datetime as dt
import json
import sys
from pathlib import Path

from batch_llm.io.storage import Location, iter_jsonl, read_json

ROOT = Path(__file__).resolve().parents[2]


def test_example_custom_steps_runs(tmp_path, airflow_db, demo_model_dir):
    sys.path.insert(0, str(ROOT / "dags"))
    from example_custom_steps import dag

    src = tmp_path / "prompts.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in [
        {"id": "a", "prompt": "Write one sentence to alice@example.com about the weather."},
        {"id": "b", "prompt": "What is the capital of Italy?"},
    ]))
    dr = dag.test(logical_date=dt.datetime(2026, 11, 5, tzinfo=dt.timezone.utc),
                  run_conf={"input_path": str(src), "engine": "transformers", "max_tokens": 16})
    assert str(dr.state).endswith("success"), dr.state
    tis = {ti.task_id: ti for ti in dr.get_task_instances()}
    redacted_url = tis["redact"].xcom_pull(task_ids="redact") if hasattr(tis["redact"], "xcom_pull") else None
    part = Location(str(ROOT / "var" / "output")).child("custom_steps_demo", "dt=2026-11-05")
    current = read_json(part.child("_CURRENT.json").path())
    rows = list(iter_jsonl(Location(current["dataset"]).path()))
    assert [r["id"] for r in rows] == ["a", "b"]
    assert "[email]" in rows[0]["prompt"] and "alice@example.com" not in rows[0]["prompt"]
    digest = read_json(Location(current["dataset"]).path().parent / "digest.json")
    assert digest["rows"] == 2 and digest["mean_words"] > 0
    del redacted_url
