"""Steps of your own around the pipeline: redact the prompts before inference, post-process after.

The pipeline is a task group; the redaction step writes a redacted copy of the input and hands its path to
the group through a templated override. The post-processing step reads the published dataset.
"""
from __future__ import annotations

import datetime as dt
import json
import re
from pathlib import Path

from airflow.sdk import DAG, task
from batch_llm.config import load_config
from batch_llm.io.storage import Location, iter_jsonl, write_json, write_jsonl
from batch_llm_airflow.task_group import batch_llm_task_group

CFG = load_config(Path(__file__).parent / "pipelines" / "demo.yaml").with_overrides(
    {"name": "custom_steps_demo", "sharding.num_shards": 1})
EMAIL = re.compile(r"[\w.+-]+@[\w-]+\.[\w.]+")

with DAG("example_custom_steps", schedule=None, start_date=dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc),
         tags=["batch_llm", "example"], default_args={"retries": 1}, params={"input_path": CFG.input.path}) as dag:

    @task
    def redact(params=None, run_id=None) -> str:
        """Masks e-mail addresses in every prompt before any model sees them."""
        src = Location(params["input_path"])
        dest = Location(CFG.output.path).child(CFG.name, "redacted", re.sub(r"\W", "_", run_id), "input.jsonl")
        rows = []
        for line in src.path().read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                rows.append({"_unparseable": line})  # left for the planner to report
                continue
            rows.append(json.loads(EMAIL.sub("[email]", json.dumps(row))))
        write_jsonl(dest.path(), rows)
        return dest.url

    @task
    def post_process(published: dict) -> dict:
        """Adds a word count per answer and writes a small digest next to the dataset."""
        rows = words = 0
        for r in iter_jsonl(Location(published["dataset"]).path()):  # streamed: a day may be millions of rows
            rows += 1
            words += len(r["output"].split())
        digest = {"rows": rows, "mean_words": words / max(rows, 1)}
        write_json(Location(published["dataset"]).path().parent / "digest.json", digest)
        return digest

    redacted = redact()
    group = batch_llm_task_group(CFG, group_id="inference", overrides={"input.path": redacted})
    redacted >> group
    post_process(group.children["inference.publish"].output)
