"""The stage operators' own decisions, executed outside a DAG run (no scheduler, no engine)."""
from __future__ import annotations

import datetime as dt
from types import SimpleNamespace

import pytest
from airflow.sdk.exceptions import AirflowFailException
from batch_llm_airflow.operators import FetchModelOperator
from helpers import demo_config


def _context() -> dict:
    day = dt.datetime(2026, 11, 30, tzinfo=dt.timezone.utc)
    return {"dag_run": SimpleNamespace(logical_date=day, run_after=day, clear_number=0), "run_id": "manual__t",
            "params": {}}


def test_fetch_fails_without_retry_on_a_folder_a_retry_cannot_fix(tmp_path):
    empty = tmp_path / "model"
    empty.mkdir()
    cfg = demo_config(tmp_path, model__ref=str(empty)).model_dump(mode="json")
    op = FetchModelOperator(task_id="fetch_model", pipeline_config=cfg, retries=3)
    with pytest.raises(AirflowFailException, match="the model folder lacks config.json"):
        op.execute(_context())


def test_fetch_of_a_folder_that_is_not_there_stays_retryable(tmp_path):
    """A missing path may be a mount not there yet: an ordinary error, which Airflow retries."""
    cfg = demo_config(tmp_path, model__ref=str(tmp_path / "absent")).model_dump(mode="json")
    op = FetchModelOperator(task_id="fetch_model", pipeline_config=cfg, retries=3)
    with pytest.raises(FileNotFoundError, match="no such folder"):
        op.execute(_context())
