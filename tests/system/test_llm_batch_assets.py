"""A GPU batch's Asset, its callbacks, on a real scheduler: ``GPULLMBatchOperator(..., outlets=[asset])`` updates
the Asset once per landed batch, after every shard, and a DAG scheduled on that Asset runs then and only then.

Real Airflow services on loopback (api-server, scheduler, dag-processor, LocalExecutor; tests/airflow_services.py)
with a DAGs folder of this test's own: a producer DAG whose one GPU batch (the transformers engine, the demo
model, two shards) has ``outlets=[asset]`` and an ``on_failure_callback``, and a consumer DAG scheduled on that
Asset, which reads the landed result file of the batch that triggered it. Three producer runs:

- ``ok_1``: lands; the consumer runs once, after the landing task, and finds all the rows the batch landed;
  the Asset's only event is the landing task's.
- ``fail_1``: one shard's worker is killed (tests/fault_injection, the run's own result folder) and the shard
  task fails (retries 0): the landing task fails naming it, the failure callback is called once, for the landing
  task; no Asset event, no consumer run.
- ``ok_2``: lands; the consumer's second run. In all: two events, two consumer runs, one per landed batch.

On the code where every task argument went to every task of the batch, the plan task updated the Asset before
any result existed (and so did every other task of the batch), and the callback was the shard's.
"""
from __future__ import annotations

import datetime as dt
import json
import textwrap
import time
from pathlib import Path

import pytest
from airflow_services import AirflowServices, print_on_failure
from helpers import FAULT_INJECTION

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PRODUCER, CONSUMER = "llm_batch_producer", "llm_batch_consumer"
REQUESTS = ["Say one word.", "Say two words.", "Say three words."]

DAG_FILE = '''
import datetime as dt
import json
from pathlib import Path

from airflow.sdk import DAG, Asset, task
from batch_llm_airflow.llm_batch import GPULLMBatchOperator

TMP = Path({tmp!r})
LANDED = Asset(name="classified_reviews", uri="file://{tmp}/landed")
START = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)


def record_failure(context):
    with open(TMP / "failure_callbacks.jsonl", "a") as f:
        f.write(json.dumps({{"task_id": context["ti"].task_id, "run_id": context["run_id"]}}) + "\\n")


with DAG({producer!r}, schedule=None, start_date=START, catchup=False):
    GPULLMBatchOperator(task_id="classify", requests={requests!r}, result_path=str(TMP / "results" / "{{{{ run_id }}}}"),
                        model_id="HuggingFaceTB/SmolLM2-135M-Instruct", config={demo_yaml!r},
                        config_overrides={{"engine.kind": "transformers", "sampling.max_tokens": 4,
                                          "sharding.num_shards": 2}},
                        outlets=[LANDED], on_failure_callback=record_failure, retries=0)

with DAG({consumer!r}, schedule=[LANDED], start_date=START, catchup=False):
    @task
    def read_landed(**context):
        seen = []
        for events in context["triggering_asset_events"].values():
            for e in events:
                files = sorted((TMP / "results" / e.source_run_id).glob("*.jsonl"))  # <key16>.jsonl, once landed
                seen.append({{"source_task_id": e.source_task_id, "source_run_id": e.source_run_id,
                             "rows": sum(len(f.read_text().splitlines()) for f in files)}})
        with open(TMP / "consumer.jsonl", "a") as f:
            f.write(json.dumps(seen) + "\\n")
        return seen

    read_landed()
'''


@pytest.fixture(scope="module")
def services(tmp_path_factory, demo_model_dir, request):
    tmp = tmp_path_factory.mktemp("llm_batch_assets")
    dags = tmp / "dags"
    dags.mkdir()
    (dags / "llm_batch_assets.py").write_text(textwrap.dedent(DAG_FILE).format(
        tmp=str(tmp), producer=PRODUCER, consumer=CONSUMER, requests=REQUESTS,
        demo_yaml=str(ROOT / "dags" / "pipelines" / "demo.yaml")))
    (tmp / "pipelines").mkdir()
    env = {"AIRFLOW__CORE__DAGS_FOLDER": str(dags), "PYTHONPATH": str(FAULT_INJECTION),
           "BATCH_LLM_FAULT_FILE": str(tmp / "fault")}
    svc = AirflowServices(tmp, pipelines_dir=tmp / "pipelines", extra_env=env)
    failed_before = request.session.testsfailed
    try:
        svc.start()
        for dag_id in (PRODUCER, CONSUMER):
            svc.wait_dag_parsed(dag_id)
            svc.unpause(dag_id)
        yield svc, tmp
    finally:
        print_on_failure(request, svc, failed_before)
        svc.stop()
        assert not svc.procs.leftovers(), "processes left behind"


def _jsonl(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _consumer_runs(svc, count: int, timeout: float = 300) -> list[dict]:
    """Waits until the consumer has ``count`` finished runs; returns them."""
    deadline = time.monotonic() + timeout
    runs: list[dict] = []
    while time.monotonic() < deadline:
        runs = svc.dag_runs(CONSUMER)
        if len(runs) >= count and all(r["state"] in ("success", "failed") for r in runs):
            break
        time.sleep(2)
    assert len(runs) == count and all(r["state"] == "success" for r in runs), runs
    return runs


def _when(stamp: str) -> dt.datetime:
    return dt.datetime.fromisoformat(stamp.replace("Z", "+00:00"))


def _events(svc) -> list[dict]:
    return svc.api("GET", "assets/events", params={"source_dag_id": PRODUCER, "limit": 100})["asset_events"]


@pytest.mark.timeout(1500)
def test_the_asset_is_updated_once_per_landed_batch_and_the_failure_callback_once(services):
    svc, tmp = services
    svc.trigger(PRODUCER, dag_run_id="ok_1")
    svc.wait_run(PRODUCER, "ok_1", timeout=600)
    (run,) = _consumer_runs(svc, 1)
    landing = next(t for t in svc.task_instances(PRODUCER, "ok_1") if t["task_id"] == "classify")
    assert _when(run["queued_at"]) >= _when(landing["end_date"]), (run, landing)
    assert _jsonl(tmp / "consumer.jsonl") == [[{"source_task_id": "classify", "source_run_id": "ok_1",
                                                "rows": len(REQUESTS)}]]
    assert [(e["source_task_id"], e["source_run_id"]) for e in _events(svc)] == [("classify", "ok_1")]

    # One shard's worker dies (only in this run's result folder): the shard fails, so does the batch, once.
    (tmp / "fault").write_text("before_manifest 1 results/fail_1/\n")
    svc.trigger(PRODUCER, dag_run_id="fail_1")
    with pytest.raises(AssertionError, match="is 'failed'"):
        svc.wait_run(PRODUCER, "fail_1", timeout=600)
    assert (tmp / "fault").read_text().split()[:2] == ["before_manifest", "0"]
    states = {(t["task_id"], t["map_index"]): t["state"] for t in svc.task_instances(PRODUCER, "fail_1")}
    assert sorted(s for (tid, _), s in states.items() if tid == "classify.batch_inference") == ["failed", "success"]
    assert states[("classify", -1)] == "failed", states           # the batch's outcome: failed, not upstream_failed
    log = "\n".join(p.read_text() for p in svc.task_log_files(PRODUCER, "fail_1", "classify"))
    assert "has nothing to land: classify.batch_inference[" in log, log[-3000:]
    assert _jsonl(tmp / "failure_callbacks.jsonl") == [{"task_id": "classify", "run_id": "fail_1"}]

    svc.trigger(PRODUCER, dag_run_id="ok_2")
    svc.wait_run(PRODUCER, "ok_2", timeout=600)
    _consumer_runs(svc, 2)
    assert [[e["source_run_id"] for e in line] for line in _jsonl(tmp / "consumer.jsonl")] == [["ok_1"], ["ok_2"]]
    assert all(e["rows"] == len(REQUESTS) for line in _jsonl(tmp / "consumer.jsonl") for e in line)
    assert sorted((e["source_task_id"], e["source_run_id"]) for e in _events(svc)) == [("classify", "ok_1"),
                                                                                       ("classify", "ok_2")]
    assert len(_jsonl(tmp / "failure_callbacks.jsonl")) == 1
