"""The pipeline on CeleryExecutor: Redis broker, PostgreSQL metadata DB and result backend, two workers on
this machine, and the inference tasks routed to the GPU worker by queue.

- ``gpu-worker``: ``airflow celery worker --queues gpu --concurrency 1`` (the GPU host; one shard at a time
  here, where a GPU host runs as many as the ``gpu`` pool and its GPU leases allow).
- ``cpu-worker`` and ``cpu-worker-b``: ``--queues default --concurrency 1`` each (every other stage), two CPU
  hosts: the mapped CPU steps of a day planned in parts (``plan_scan``, ``plan_join``, ``plan_write``,
  ``filter_shard``) spread over both.

Two faults a fleet has, each on a DAG of its own (own rows, so no result-cache hit hides the work): the
scheduler killed mid-run and restarted (the shard runs on; nothing runs twice), and the GPU worker's host
dying mid-shard (SIGKILL to the worker and every process under it), a new worker started: the scheduler
finds the task's heartbeat gone, retries it, and the retry resumes after the chunks the dead attempt
committed; the published partition holds every row once.

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
import json
import os
import re
import time
from pathlib import Path

import pytest
import yaml
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
from batch_llm.io.storage import Location, iter_jsonl, read_json

pytestmark = pytest.mark.slow

DAG_ID = "celery_demo"
NUM_SHARDS = 2
TODAY = dt.datetime.now(dt.timezone.utc).date()
# Two default-queue workers of one slot each: two CPU hosts the mapped CPU steps spread over
WORKERS = [CeleryWorker("gpu-worker", queues="gpu", concurrency=1),
           CeleryWorker("cpu-worker", queues="default", concurrency=1),
           CeleryWorker("cpu-worker-b", queues="default", concurrency=1)]
CPU_WORKERS = ("cpu-worker", "cpu-worker-b")
PARTS_DAG, PARTS = "celery_plan_parts", 4
SCHEDULER_KILLED_DAG, WORKER_KILLED_DAG = "celery_scheduler_killed", "celery_worker_killed"
FAULT_ROWS = 24
# A task whose heartbeat stops is failed (and retried) after this long; Airflow's default is 300 s.
HEARTBEAT_TIMEOUT_S = 60


def write_fault_pipeline(tmp: Path, pipelines: Path, name: str) -> tuple[Path, list[str]]:
    """One shard of FAULT_ROWS rows of its own (prompts no other DAG has), committed two rows at a time, so a
    fault lands mid-shard. Returns (output dir, ids)."""
    sub, out, _ = write_test_pipeline(tmp / name, name=name, days=[TODAY, TODAY + dt.timedelta(days=1)],
                                      rows_per_day=1, num_shards=1, schedule=None,
                                      start_date=TODAY - dt.timedelta(days=3), evaluate=False)
    cfg = yaml.safe_load((sub / f"{name}.yaml").read_text())
    cfg["engine"].update({"batch_size": 2, "commit_every_rows": 2})
    (pipelines / f"{name}.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    rows = [{"id": f"{name}-{i:03d}", "messages": [{"role": "user", "content": f"In one sentence: why might a "
                                                    f"{name.split('_')[1]} count to {i}?"}]}
            for i in range(FAULT_ROWS)]
    for day in (TODAY, TODAY + dt.timedelta(days=1)):
        (tmp / name / "in" / f"dt={day.isoformat()}" / "prompts.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in rows))
    return out, [r["id"] for r in rows]


def write_parts_pipeline(tmp: Path, pipelines: Path) -> tuple[Path, list[str]]:
    """A day in PARTS files planned in parts (``sharding.plan_part_bytes``: one file a part), a shard a part,
    ``output.parts``. Returns (output dir, ids)."""
    sub, out, _ = write_test_pipeline(tmp / PARTS_DAG, name=PARTS_DAG, days=[TODAY, TODAY + dt.timedelta(days=1)],
                                      rows_per_day=1, num_shards=1, schedule=None,
                                      start_date=TODAY - dt.timedelta(days=3), evaluate=False)
    rows = [{"id": f"parts-{i:03d}", "messages": [{"role": "user", "content": f"Name a colour, {i}."}]}
            for i in range(4 * PARTS)]
    for day in (TODAY, TODAY + dt.timedelta(days=1)):
        folder = tmp / PARTS_DAG / "in" / f"dt={day.isoformat()}"
        (folder / "prompts.jsonl").unlink()
        for p in range(PARTS):
            (folder / f"part-{p}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[4 * p:4 * p + 4]))
    cfg = yaml.safe_load((sub / f"{PARTS_DAG}.yaml").read_text())
    cfg["input"]["path"] = str(tmp / PARTS_DAG / "in" / "dt={ds}")
    cfg["output"]["parts"] = True
    cfg["sharding"] = {"rows_per_shard": 4, "plan_part_bytes": 1}
    cfg["sampling"]["max_tokens"] = 8
    (pipelines / f"{PARTS_DAG}.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return out, [r["id"] for r in rows]


@pytest.fixture(scope="module")
def celery_services(tmp_path_factory, demo_model_dir, request):
    ensure_system_services()   # scripts/services.sh ensure: apt-installs redis-server / postgresql if missing
    tmp = tmp_path_factory.mktemp("celery")
    # today and tomorrow: a run triggered just before midnight UTC still finds its partition's input
    pipelines, out, ids = write_test_pipeline(tmp, name=DAG_ID, days=[TODAY, TODAY + dt.timedelta(days=1)],
                                              rows_per_day=8, num_shards=NUM_SHARDS, schedule=None,
                                              start_date=TODAY - dt.timedelta(days=3), evaluate=False)
    fault_dags = {name: write_fault_pipeline(tmp, pipelines, name) for name in (SCHEDULER_KILLED_DAG, WORKER_KILLED_DAG)}
    fault_dags[PARTS_DAG] = write_parts_pipeline(tmp, pipelines)
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
                       "AIRFLOW__CELERY__RESULT_BACKEND": "db+" + pg.url("postgresql+psycopg2"),
                       "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": str(HEARTBEAT_TIMEOUT_S),
                       "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL": "5",
                       "AIRFLOW__SCHEDULER__ORPHANED_TASKS_CHECK_INTERVAL": "15"})
        svc.start()
        for dag_id in (DAG_ID, *fault_dags):
            svc.wait_dag_parsed(dag_id)
        yield svc, out, ids, fault_dags
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
    svc, out, ids, _ = celery_services
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
        assert t["hostname"].split("@")[0] in CPU_WORKERS, (t["task_id"], t["hostname"])

    # The workers' own logs agree.
    logs = {w.name: (svc.procs.log_dir / f"celery-{w.name}.log").read_text(errors="replace") for w in WORKERS}
    gpu_ran = executed_task_ids(logs["gpu-worker"])
    cpu_ran = [t for w in CPU_WORKERS for t in executed_task_ids(logs[w])]
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


def test_a_day_planned_in_parts_spreads_its_mapped_steps_over_both_cpu_workers(celery_services):
    """plan_scan × 4, plan_join × 4, plan_write × 4 and filter_shard × 4 on two one-slot CPU workers: both
    ran some of them, every other task ran where its queue says, and the day is published whole."""
    svc, _, _, fault_dags = celery_services
    out, ids = fault_dags[PARTS_DAG]
    svc.unpause(PARTS_DAG)
    run = svc.trigger(PARTS_DAG, logical_date=None)
    svc.wait_run(PARTS_DAG, run["dag_run_id"], timeout=900)
    tis = svc.task_instances(PARTS_DAG, run["dag_run_id"])
    assert {t["state"] for t in tis} == {"success"}, [(t["task_id"], t["state"]) for t in tis]
    mapped = [t for t in tis if t["task_id"].split(".")[-1] in ("plan_scan", "plan_join", "plan_write",
                                                                 "filter_shard")]
    assert len(mapped) == 4 * PARTS, sorted((t["task_id"], t["map_index"]) for t in mapped)
    hosts = {t["hostname"].split("@")[0] for t in mapped}
    assert hosts == set(CPU_WORKERS), sorted((t["task_id"], t["map_index"], t["hostname"]) for t in mapped)
    for t in tis:
        on = t["hostname"].split("@")[0]
        assert on == "gpu-worker" if t["task_id"].endswith("batch_inference") else on in CPU_WORKERS, t
    got = published_ids(out, PARTS_DAG, run, parts=True)
    assert sorted(got) == sorted(ids) and len(got) == len(set(got)), got
    svc.assert_loopback_only()


def committed_ids(out: Path, dag_id: str) -> list[str]:
    """Ids in the shard chunks committed so far (a chunk file appears whole or not at all)."""
    return [r["id"] for f in sorted((out / dag_id).rglob("chunks/*.jsonl")) for r in iter_jsonl(f)]


def wait_mid_shard(svc, out: Path, dag_id: str, run_id: str, timeout: float = 600) -> int:
    """Waits until the shard has committed some rows, not all; returns how many."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        n = len(committed_ids(out, dag_id))
        if 0 < n < FAULT_ROWS:
            return n
        assert n < FAULT_ROWS, "the shard finished before the fault: make it longer"
        run = svc.api("GET", f"dags/{dag_id}/dagRuns/{run_id}")
        assert run["state"] not in ("success", "failed"), svc.describe_run(dag_id, run_id)
        time.sleep(0.2)
    raise AssertionError(f"no chunk committed in {timeout:.0f}s\n" + svc.describe_run(dag_id, run_id))


def published_ids(out: Path, dag_id: str, run: dict, parts: bool = False) -> list[str]:
    """The ids of the run_after day's current version (``parts``: its data folder's files, output.parts)."""
    day = dt.datetime.fromisoformat(run["run_after"].replace("Z", "+00:00")).astimezone(dt.timezone.utc).date()
    current = read_json(Location(str(out)).child(dag_id, f"dt={day.isoformat()}", "_CURRENT.json").path())
    assert current["run_id"] == run["dag_run_id"], current
    if parts:
        data = Location(current["version"]).child("data").path()
        return [r["id"] for f in sorted(data.iterdir()) for r in iter_jsonl(f)]
    return [r["id"] for r in iter_jsonl(Location(current["dataset"]).path())]


def run_until_mid_shard(svc, fault_dags: dict, dag_id: str) -> tuple[Path, list[str], dict]:
    """Triggers a fault DAG and returns (output dir, ids, run) once its shard has committed some rows."""
    out, ids = fault_dags[dag_id]
    svc.unpause(dag_id)
    run = svc.trigger(dag_id, logical_date=None)
    wait_mid_shard(svc, out, dag_id, run["dag_run_id"])
    return out, ids, run


def test_scheduler_killed_mid_run_restarts_and_nothing_runs_twice(celery_services):
    svc, _, _, fault_dags = celery_services
    out, ids, run = run_until_mid_shard(svc, fault_dags, SCHEDULER_KILLED_DAG)
    assert svc.procs.crash("scheduler")
    time.sleep(3)
    svc.spawn_scheduler("scheduler-restarted")
    svc.wait_run(SCHEDULER_KILLED_DAG, run["dag_run_id"], timeout=900)
    tis = svc.task_instances(SCHEDULER_KILLED_DAG, run["dag_run_id"])
    assert {t["state"] for t in tis} == {"success"}, [(t["task_id"], t["state"]) for t in tis]
    infer = [t for t in tis if t["task_id"].endswith("batch_inference")]
    assert [t["try_number"] for t in infer] == [1], infer   # the shard ran on while no scheduler was up
    got = published_ids(out, SCHEDULER_KILLED_DAG, run)
    assert sorted(got) == sorted(ids) and len(got) == len(set(got))


def test_gpu_worker_host_dies_mid_shard_the_retry_resumes(celery_services):
    svc, _, _, fault_dags = celery_services
    out, ids, run = run_until_mid_shard(svc, fault_dags, WORKER_KILLED_DAG)
    killed = svc.procs.crash("celery-gpu-worker")   # the worker, its task processes and the shard's engine
    committed = committed_ids(out, WORKER_KILLED_DAG)
    assert 0 < len(committed) < FAULT_ROWS and len(killed) >= 3, (len(committed), killed)
    t_dead = time.monotonic()
    svc.spawn_celery_worker(WORKERS[0], name="celery-gpu-worker-replacement")
    svc.wait_run(WORKER_KILLED_DAG, run["dag_run_id"], timeout=900)
    assert time.monotonic() - t_dead >= HEARTBEAT_TIMEOUT_S - 10   # found by its missing heartbeat
    tis = svc.task_instances(WORKER_KILLED_DAG, run["dag_run_id"])
    infer = [t for t in tis if t["task_id"].endswith("batch_inference")]
    assert [(t["state"], t["try_number"]) for t in infer] == [("success", 2)], infer
    assert infer[0]["hostname"].startswith("gpu-worker@"), infer
    log = svc.task_log_files(WORKER_KILLED_DAG, run["dag_run_id"], infer[0]["task_id"], infer[0]["map_index"])
    retry_log = [p for p in log if p.name == "attempt=2.log"][0].read_text(errors="replace")
    assert f"resuming shard 0: {len(set(committed))} rows already committed" in retry_log, retry_log[-3000:]
    got = published_ids(out, WORKER_KILLED_DAG, run)
    assert sorted(got) == sorted(ids) and len(got) == len(set(got)), "a row lost or published twice"
