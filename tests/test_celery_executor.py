"""The pipeline on CeleryExecutor: Redis broker, PostgreSQL metadata DB and result backend, two workers on
this machine, and the inference tasks routed to the GPU worker by queue.

- ``gpu-worker``: ``airflow celery worker --queues gpu --concurrency 1`` (the GPU host; one shard at a time
  here, where a GPU host runs as many as the ``gpu`` pool and its GPU leases allow).
- ``cpu-worker``: ``--queues default --concurrency 2`` (every other stage).

``batch_inference`` is mapped with ``.partial(queue=airflow.gpu_queue, pool=airflow.gpu_pool)``; every other
task keeps ``[operators] default_queue`` (``default``). Both workers run on one machine, so each tells the task
instances its own name through ``[core] hostname_callable`` (``airflow_services.worker_hostname``), as two
hosts would; the workers' own logs ("Executing workload in Celery") are checked as well.

The result backend names its driver (``db+postgresql+psycopg2://``): SQLAlchemy 2.1 maps a bare
``postgresql://`` to psycopg 3, which is not installed, and the Celery CLI reports that ImportError as
"Failed to import providers_configuration_loaded. This feature is only available in Airflow versions >= 2.8.0".

On KubernetesExecutor the queue means nothing: the same split is a ``pod_override`` (GPU resource request,
node selector / toleration) in ``executor_config`` on the ``batch_inference`` partial, every other task
running in the default pod template.
"""
from __future__ import annotations

import datetime as dt
import os
import re

import pytest
from airflow_services import (
    AirflowServices,
    CeleryWorker,
    Postgres,
    ProcessGroup,
    Redis,
    ensure_system_services,
    print_on_failure,
    write_test_pipeline,
)
from batch_llm.storage import Location, iter_jsonl, read_json

pytestmark = pytest.mark.slow

DAG_ID = "celery_demo"
NUM_SHARDS = 2
TODAY = dt.datetime.now(dt.timezone.utc).date()
WORKERS = [CeleryWorker("gpu-worker", queues="gpu", concurrency=1),
           CeleryWorker("cpu-worker", queues="default", concurrency=2)]


@pytest.fixture(scope="module")
def celery_services(tmp_path_factory, demo_model_dir, request):
    ensure_system_services()   # scripts/services.sh ensure: apt-installs redis-server / postgresql if missing
    tmp = tmp_path_factory.mktemp("celery")
    # today and tomorrow: a run triggered just before midnight UTC still finds its partition's input
    pipelines, out, ids = write_test_pipeline(tmp, name=DAG_ID, days=[TODAY, TODAY + dt.timedelta(days=1)],
                                              rows_per_day=8, num_shards=NUM_SHARDS, schedule=None,
                                              start_date=TODAY - dt.timedelta(days=3), evaluate=False)
    procs = ProcessGroup(tmp / "service-logs", {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")})
    pg = None
    svc = None
    failed_before = request.session.testsfailed
    try:
        redis = Redis(procs, tmp / "redis")
        pg = Postgres(procs)
        svc = AirflowServices(
            tmp, pipelines_dir=pipelines, executor="CeleryExecutor", sql_alchemy_conn=pg.url(),
            celery_workers=WORKERS, procs=procs,
            extra_env={"AIRFLOW__CELERY__BROKER_URL": redis.url,
                       "AIRFLOW__CELERY__RESULT_BACKEND": "db+" + pg.url("postgresql+psycopg2")})
        svc.start()
        svc.wait_dag_parsed(DAG_ID)
        yield svc, out, ids
    finally:
        if svc is not None:
            print_on_failure(request, svc, failed_before)
        killed = procs.stop()
        print(f"services: {svc.timings if svc else None}; needed SIGKILL: {killed}")
        if pg is not None:
            pg.cleanup()
        assert not procs.leftovers(), "processes left behind"


def executed_task_ids(worker_log: str) -> list[str]:
    """task_ids of the workloads a Celery worker's log says it executed."""
    return re.findall(r"Executing workload in Celery: .*?task_id='([^']+)'", worker_log)


def test_inference_runs_on_gpu_worker_rest_on_default(celery_services):
    svc, out, ids = celery_services
    svc.unpause(DAG_ID)
    run = svc.trigger(DAG_ID, logical_date=None)
    svc.wait_run(DAG_ID, run["dag_run_id"], timeout=900)

    tis = svc.task_instances(DAG_ID, run["dag_run_id"])
    infer = [t for t in tis if t["task_id"].endswith("batch_inference")]
    rest = [t for t in tis if not t["task_id"].endswith("batch_inference")]
    assert sorted(t["map_index"] for t in infer) == list(range(NUM_SHARDS)), infer
    assert {t["state"] for t in tis} == {"success"}, [(t["task_id"], t["state"]) for t in tis]
    for t in infer:
        assert t["queue"] == "gpu" and t["pool"] == "gpu", t
        assert t["hostname"].startswith("gpu-worker@"), (t["task_id"], t["map_index"], t["hostname"])
    for t in rest:
        assert t["queue"] == "default", (t["task_id"], t["queue"])
        assert t["hostname"].startswith("cpu-worker@"), (t["task_id"], t["hostname"])

    # The workers' own logs agree.
    logs = {w.name: (svc.procs.log_dir / f"celery-{w.name}.log").read_text(errors="replace") for w in WORKERS}
    gpu_ran, cpu_ran = executed_task_ids(logs["gpu-worker"]), executed_task_ids(logs["cpu-worker"])
    assert gpu_ran and all(t.endswith("batch_inference") for t in gpu_ran), gpu_ran
    assert len(gpu_ran) >= NUM_SHARDS, gpu_ran
    assert cpu_ran and not any(t.endswith("batch_inference") for t in cpu_ran), cpu_ran

    # And the pipeline did its job: the run_after day's partition holds every input id once.
    day = dt.datetime.fromisoformat(run["run_after"].replace("Z", "+00:00")).astimezone(dt.timezone.utc).date()
    part = Location(str(out)).child(DAG_ID, f"dt={day.isoformat()}")
    current = read_json(part.child("_CURRENT.json").path())
    assert current["run_id"] == run["dag_run_id"], current
    got = [r["id"] for r in iter_jsonl(Location(current["dataset"]).path())]
    assert sorted(got) == sorted(ids[day.isoformat()]) and len(got) == len(set(got)), got
    svc.assert_loopback_only()   # scheduler, api-server, both workers, Redis, PostgreSQL
