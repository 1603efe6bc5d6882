"""One DAG per pipeline YAML file, in a DAG file of its own (broken: an import error) or in the folder's:

- **A DAG file of its own** (``pipeline_file_dags``): ``<name>.py`` beside ``<name>.yaml`` in the pipelines
  folder, three lines (``dags/pipelines/demo.py``). A broken pipeline file makes that DAG file's import raise,
  which is how Airflow reports a broken DAG: its import errors (the UI's banner, ``DagBag.import_errors``, the
  REST API's ``importErrors``, the ``dag_processing.import_errors`` metric); the other pipelines, in files of
  their own, load.
- **The folder's DAG file** (``build_pipeline_dags``, ``dags/batch_llm_pipelines.py``): every pipeline file
  without a DAG file of its own, all in one DAG file, so one broken file must not raise there: it becomes a DAG
  ``<file>__invalid_config`` that shows its error.
"""
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
from batch_llm_airflow.pools import task_slots
from batch_llm_airflow.task_group import batch_llm_task_group

log = logging.getLogger(__name__)


def pipeline_dag(cfg: PipelineConfig, *, source: str = "") -> DAG:
    a = cfg.airflow
    default_args = {"retries": a.retries, "retry_delay": dt.timedelta(seconds=a.retry_delay_seconds)}
    if a.execution_timeout_minutes:
        default_args["execution_timeout"] = dt.timedelta(minutes=a.execution_timeout_minutes)
    # the pool a scheduler needs before it queues the GPU tasks (no DAG file can create one): said where the
    # DAG is listed, and how to make it (batch_llm_airflow.pools does it for every pipeline)
    pool = f"needs Airflow pool '{a.gpu_pool}', {task_slots(cfg)} slot(s) a GPU task"
    with DAG(dag_id=cfg.name, description=f"{cfg.description}; {pool}" if cfg.description else pool.capitalize(),
             schedule=a.schedule,
             start_date=dt.datetime.fromisoformat(a.start_date).replace(tzinfo=dt.timezone.utc), catchup=a.catchup,
             default_args=default_args, params=params_for(cfg), tags=["batch_llm", *a.tags],
             doc_md=f"Batch LLM pipeline from `{source}`.\n\n{cfg.description}\n\n**Pool.** This DAG {pool}: "
                    f"`airflow pools set {a.gpu_pool} <GPUs of the {a.gpu_queue!r} queue's workers> <description>`, "
                    "or `python -m batch_llm_airflow.pools --slots <GPUs> <pipelines folder>`.",
             max_active_runs=4) as dag:
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


PIPELINE_SUFFIXES = (".yaml", ".yml")


def has_own_dag_file(path: Path) -> bool:
    """Whether the pipeline file ``path`` has a DAG file of its own (``<name>.py`` beside it)."""
    return path.with_suffix(".py").is_file()


def pipeline_file_dags(dag_file: str | Path, *, default_dir: Path | None = None) -> dict[str, DAG]:
    """The DAG of the pipeline file beside ``dag_file`` (``<name>.yaml`` or ``.yml`` for ``<name>.py``), for a
    pipeline's own DAG file: ``globals().update(pipeline_file_dags(__file__))``. An invalid or missing pipeline
    file, or a name an earlier file of the folder (by file name) already has, raises ``ConfigError``: the DAG
    file's import error, the rest of the folder unaffected. Nothing where the pipelines folder in use
    (``$BATCH_LLM_PIPELINES_DIR``, else ``default_dir``, else the DAG file's folder) is another one: a deployment
    that reads its pipelines from elsewhere does not get these too."""
    here = Path(dag_file).resolve().parent
    if pipelines_dir(default_dir or here).resolve() != here:
        return {}
    stem = Path(dag_file).stem
    found = [p for p in (here / f"{stem}{s}" for s in PIPELINE_SUFFIXES) if p.is_file()]
    if len(found) != 1:
        raise ConfigError(f"{dag_file}: a pipeline's DAG file needs one pipeline file {stem}.yaml or {stem}.yml "
                          f"beside it; found {len(found)}")
    path = found[0]
    cfg = load_config(path)
    earlier = sorted(p for p in here.iterdir() if p.suffix in PIPELINE_SUFFIXES and p.name < path.name)
    for other in _files_naming(cfg.name, earlier):
        # a pipeline's name is its DAG id: two files of one name would take turns holding the DAG
        if _loads_name(other) == cfg.name:
            raise ConfigError(f"{path}: name: {cfg.name!r} is also the name of {other}, which keeps that DAG (the "
                              "first file by name does); give each pipeline file its own name")
    return {cfg.name: pipeline_dag(cfg, source=path.name)}


def _loads_name(path: Path) -> str | None:
    try:
        return load_config(path).name
    except ConfigError:
        return None  # a broken file is its own error, and holds no name


# The share of Airflow's DAG-file import timeout (core.dagbag_import_timeout) that loading pipeline files may
# take; the rest is left to building and serializing the DAGs. A file reached after it is its own error.
IMPORT_BUDGET_SHARE = 0.5


def import_budget_s() -> float:
    """Seconds the pipeline files of one DAG file may take to load (no bound where Airflow sets no timeout)."""
    from airflow.configuration import conf

    timeout = conf.getfloat("core", "dagbag_import_timeout", fallback=30.0)
    return timeout * IMPORT_BUDGET_SHARE if timeout > 0 else math.inf


def build_pipeline_dags(folder: Path, *, budget_s: float | None = None,
                        dag_folder: Path | None = None) -> dict[str, DAG]:
    """A DAG per pipeline file of ``folder``, in file-name order. A file that cannot be one (invalid, too big,
    a name an earlier file already took, reached after ``budget_s`` seconds of loading: by default a share of
    Airflow's import timeout) becomes ``<file>__invalid_config``, so the DAG file itself always imports. Where
    ``folder`` lies within ``dag_folder`` (the calling DAG file's folder, which Airflow parses), a file with a DAG
    file of its own is left to that one; elsewhere such a ``.py`` is never parsed."""
    budget = import_budget_s() if budget_s is None else budget_s
    dags: dict[str, DAG] = {}
    owners: dict[str, Path] = {}  # pipeline name: the file whose DAG it is
    parsed = dag_folder is not None and Path(folder).resolve().is_relative_to(Path(dag_folder).resolve())
    # a file with a DAG file of its own is built there, and reported broken as that file's import error
    paths = [p for p in sorted(Path(folder).glob("*.y*ml")) if not (parsed and has_own_dag_file(p))]
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
