"""One DAG per pipeline YAML file. A broken file becomes a DAG that shows its error, never an import error
that would hide the other pipelines."""
from __future__ import annotations

import datetime as dt
import logging
import math
import os
import re
import time
from pathlib import Path

from airflow.sdk import DAG, get_parsing_context, task
from batch_llm.config import ConfigError, PipelineConfig, load_config
from batch_llm.host import path_policy

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


# The share of Airflow's DAG-file import timeout (core.dagbag_import_timeout) that loading pipeline files may
# take; the rest is left to building and serializing the DAGs. A file reached after it is its own error.
IMPORT_BUDGET_SHARE = 0.5


def import_budget_s() -> float:
    """Seconds the pipeline files of one DAG file may take to load (no bound where Airflow sets no timeout)."""
    from airflow.configuration import conf

    timeout = conf.getfloat("core", "dagbag_import_timeout", fallback=30.0)
    return timeout * IMPORT_BUDGET_SHARE if timeout > 0 else math.inf


def build_pipeline_dags(folder: Path, *, budget_s: float | None = None) -> dict[str, DAG]:
    """A DAG per pipeline file of ``folder``, in file-name order. A file that cannot be one (invalid, too big,
    a name an earlier file already took, reached after ``budget_s`` seconds of loading: by default a share of
    Airflow's import timeout) becomes ``<file>__invalid_config``, so the DAG file itself always imports."""
    budget = import_budget_s() if budget_s is None else budget_s
    dags: dict[str, DAG] = {}
    owners: dict[str, Path] = {}  # pipeline name: the file whose DAG it is
    paths = sorted(Path(folder).glob("*.y*ml"))
    wanted = get_parsing_context().dag_id  # set in a task's process: it needs its own DAG only
    if wanted and not wanted.endswith("__invalid_config"):
        paths = _files_naming(wanted, paths) or paths
    t0 = time.monotonic()
    for path in paths:
        try:
            spent = time.monotonic() - t0
            if spent > budget:
                raise ConfigError(f"{path}: not loaded: the pipeline files before it took {spent:.1f} s of the "
                                  f"{budget:.1f} s this DAG file may spend loading pipelines (half of Airflow's "
                                  "core.dagbag_import_timeout); make them smaller or fewer, or raise the timeout")
            cfg = load_config(path)
            if cfg.name in owners:
                # a pipeline's name is its DAG id: a second file of that name would silently take the DAG
                raise ConfigError(f"{path}: name: {cfg.name!r} is also the name of {owners[cfg.name]}, which keeps "
                                  "that DAG (the first file by name does); give each pipeline file its own name")
            owners[cfg.name] = path
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


def _files_naming(name: str, paths: list[Path]) -> list[Path]:
    """The files that may be the pipeline ``name``, in order: those holding ``name`` as the value of a ``name``
    key, found by a text search without parsing (a false match costs one load: the loop checks each file's real
    name, and the first file of that name keeps its DAG as in a full parse). A file that cannot be read is kept."""
    pattern = re.compile(rb"""name['"]?\s*:\s*['"]?""" + re.escape(name.encode()) + rb"""(?![\w.-])""")
    found = []
    for path in paths:
        try:
            text = path_policy.read_local_bounded(str(path), path_policy.MAX_PIPELINE_FILE_BYTES)
        except (OSError, ValueError):
            found.append(path)
            continue
        if pattern.search(text):
            found.append(path)
    return found
