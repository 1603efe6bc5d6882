"""A downstream DAG scheduled on the demo pipeline's Asset: it runs whenever a partition is published."""
from __future__ import annotations

import datetime as dt
from pathlib import Path

from airflow.sdk import DAG, task
from batch_llm.config import load_config
from batch_llm_airflow.task_group import pipeline_asset

DEMO = pipeline_asset(load_config(Path(__file__).parent / "pipelines" / "demo.yaml"))

with DAG("example_downstream_of_demo", schedule=[DEMO], start_date=dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc),
         tags=["batch_llm", "example"]) as dag:

    @task(inlets=[DEMO])
    def announce(triggering_asset_events=None) -> list[dict]:
        """Reads what the publish task attached to the asset event: partition, dataset, rows, run id."""
        extras = [e.extra for events in (triggering_asset_events or {}).values() for e in events]
        for extra in extras:
            print(f"new partition {extra.get('partition')}: {extra.get('rows')} rows at {extra.get('dataset')}")
        return extras

    announce()
