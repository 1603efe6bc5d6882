"""One DAG per pipeline YAML file. A broken file becomes a DAG that shows its error, never an import error
that would hide the other pipelines."""
from __future__ import annotations

import datetime as dt
import logging
import os
from pathlib import Path

from airflow.sdk import DAG, task
from batch_llm.config import ConfigError, PipelineConfig, load_config

from batch_llm_airflow.params import params_for
from batch_llm_airflow.task_group import batch_llm_task_group

log = logging.getLogger(__name__)


def pipeline_dag(cfg: PipelineConfig, *, source: str = "") -> DAG:
    a = cfg.airflow
    default_args = {"retries": a.retries, "retry_delay": dt.timedelta(seconds=a.retry_delay_seconds)}
    if a.execution_timeout_minutes:
        default_args["execution_timeout"] = dt.timedelta(minutes=a.execution_timeout_minutes)
    with DAG(dag_id=cfg.name, description=cfg.description or None, schedule=a.schedule,
             start_date=dt.datetime.fromisoformat(a.start_date).replace(tzinfo=dt.timezone.utc), catchup=a.catchup,
             default_args=default_args, params=params_for(cfg), tags=["batch_llm", *a.tags],
             doc_md=f"Batch LLM pipeline from `{source}`.\n\n{cfg.description}", max_active_runs=4) as dag:
        batch_llm_task_group(cfg, group_id="pipeline")
    return dag


def invalid_config_dag(path: Path, error: str) -> DAG:
    """Stands in for a pipeline whose YAML is invalid: its docs show the error, its one task fails with it."""
    with DAG(dag_id=f"{path.stem}__invalid_config".replace(" ", "_"), schedule=None,
             start_date=dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc), tags=["batch_llm", "invalid-config"],
             doc_md=f"**Invalid pipeline configuration**\n\n```\n{error}\n```") as dag:
        @task(task_id="report_config_error", retries=0)
        def report_config_error() -> None:
            raise ConfigError(error)

        report_config_error()
    return dag


def pipelines_dir(default: Path) -> Path:
    return Path(os.environ.get("BATCH_LLM_PIPELINES_DIR", default))


def build_pipeline_dags(folder: Path) -> dict[str, DAG]:
    dags: dict[str, DAG] = {}
    for path in sorted(Path(folder).glob("*.y*ml")):
        try:
            cfg = load_config(path)
            dags[cfg.name] = pipeline_dag(cfg, source=path.name)
        except ConfigError as e:
            log.error("invalid pipeline config:\n%s", e)
            d = invalid_config_dag(path, str(e))
            dags[d.dag_id] = d
        except Exception as e:  # noqa: BLE001 - any failure of one file (a schedule Airflow refuses, a bug) costs
            # that pipeline's DAG only: all pipelines are built in one DAG file, whose import error would hide all
            log.exception("pipeline %s: building its DAG failed", path.name)
            d = invalid_config_dag(path, f"{path}: building the DAG failed: {type(e).__name__}: {e}")
            dags[d.dag_id] = d
    return dags
