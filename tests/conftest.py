"""Test setup: an Airflow home of the test session's own (SQLite), the offline demo model, and offline switches
for every library that would reach for a hub. batch_llm and batch_llm_airflow come from the installed
distribution (scripts/setup.sh: an editable install), not from sys.path or PYTHONPATH."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# One folder per pytest-xdist worker (make test runs two): dag.test()'s SQLite database is one writer's
VAR = ROOT / "var" / "test" / os.environ.get("PYTEST_XDIST_WORKER", "main")
VAR.mkdir(parents=True, exist_ok=True)

os.environ.setdefault("AIRFLOW_HOME", str(VAR / "airflow"))
os.environ["AIRFLOW__CORE__DAGS_FOLDER"] = str(ROOT / "dags")
os.environ["AIRFLOW__CORE__PLUGINS_FOLDER"] = str(ROOT / "plugins")
os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
os.environ.setdefault("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", f"sqlite:///{VAR / 'airflow' / 'airflow.db'}")
os.environ.setdefault("BATCH_LLM_MODEL_CACHE", str(ROOT / ".cache" / "modelscope"))
os.environ.setdefault("MODELSCOPE_CACHE", os.environ["BATCH_LLM_MODEL_CACHE"])
for k, v in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
             "TOKENIZERS_PARALLELISM": "false", "BATCH_LLM_GPUS": ""}.items():
    os.environ.setdefault(k, v)
(VAR / "airflow").mkdir(parents=True, exist_ok=True)
# Two xdist workers (make test) share the cores: one OpenMP thread per process, or PyTorch's threads spin
# against each other's (a transformers shard took minutes instead of seconds); and vLLM's CPU engine pins
# its thread to every core but the last (its automatic binding), so both workers' engines would share core 0
# while core 1 idles: each worker's engines get a core of their own.
if os.environ.get("PYTEST_XDIST_WORKER", "").startswith("gw"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND",
                          str(int(os.environ["PYTEST_XDIST_WORKER"][2:]) % (os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def airflow_db() -> None:
    """A migrated metadata database for dag.test() (once per session)."""
    subprocess.run([sys.executable, "-m", "airflow", "db", "migrate"], check=True, capture_output=True)


@pytest.fixture(scope="session")
def demo_model_dir() -> Path:
    from batch_llm.demo_model import build_demo_model

    return build_demo_model()


@pytest.fixture(scope="session")
def demo_config_path() -> Path:
    return ROOT / "dags" / "pipelines" / "demo.yaml"


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A real S3 server (SeaweedFS ``weed mini``) on loopback for the module (its connection must not leak into
    the Airflow services that later tests start), and Airflow connection ``lake``
    pointing at it (``AIRFLOW_CONN_LAKE``). Yields the ``tests.s3_server.S3Server`` (endpoint, key, secret,
    bucket; ``stop()`` / ``start()`` for an outage)."""
    from s3_server import S3Server

    with S3Server(tmp_path_factory.mktemp("s3"), bucket="batch-llm-lake") as server:
        os.environ["AIRFLOW_CONN_LAKE"] = server.connection_json()
        try:
            yield server
        finally:
            os.environ.pop("AIRFLOW_CONN_LAKE", None)


# The longest modules (2-6 min each here) first: make test's two xdist workers (--dist loadfile, and
# --no-loadscope-reorder, else xdist orders modules by their number of tests) take them at once and the many
# short modules fill in behind, so both workers finish at about the same time.
LONGEST_FIRST = ("test_celery_executor.py", "test_openai_batch.py", "test_quantize.py", "test_resume.py",
                 "test_engine_faults.py", "test_rest_backfill.py", "test_s3_pipeline.py",
                 "test_pipeline_e2e.py", "test_structured_outputs.py", "test_review.py", "test_reasoning.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
