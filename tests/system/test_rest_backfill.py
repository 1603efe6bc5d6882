"""A pipeline through real Airflow services (api-server, scheduler, dag-processor, LocalExecutor on SQLite),
driven only through the REST API: a 3-day backfill (POST /api/v2/backfills), a run triggered with
``logical_date: null``, a failed run brought back by clearing its one failed task (the UI's *Clear*), and the
Clear of one shard's filter, which redoes that shard's part alone.

Airflow behaviours this test works with:

- Backfill runs are created for a paused DAG too, but the scheduler queues no task of a paused DAG: the DAG
  has to be unpaused for the backfill to run.
- ``@daily`` is a CronTriggerTimetable in Airflow 3 (``[scheduler] create_cron_data_intervals`` False): the
  logical date is the trigger time (00:00 of the day), so the backfill's runs write partitions
  dt=<from>..dt=<to>. With ``catchup: false`` unpausing still creates one scheduled run, for today 00:00.
  The backfill here ends today and is created before the DAG is unpaused, so its run for today takes that
  slot: the scheduler skips a logical date that already has a run, and no extra scheduled run appears.
- A run triggered with ``logical_date: null`` has no ``ds``; the operators take the partition date from the
  run's ``run_after`` (``operators.run_date``).
"""
from __future__ import annotations

import datetime as dt
import re
import shutil
import time
from pathlib import Path

import pytest
from airflow_services import AirflowServices, print_on_failure, write_test_pipeline
from batch_llm.io.storage import Location, iter_jsonl, read_json
from helpers import FAULT_INJECTION

pytestmark = pytest.mark.slow

DAG_ID = "backfill_demo"
ROWS_PER_DAY = 5
TODAY = dt.datetime.now(dt.timezone.utc).date()
DAYS = [TODAY - dt.timedelta(days=2), TODAY - dt.timedelta(days=1), TODAY]   # the backfill's three days
CLEAR_DAY = TODAY - dt.timedelta(days=5)                                     # the Clear test's run
FILTER_DAY = TODAY - dt.timedelta(days=7)                                    # the filter-Clear test's run (2 shards)
# Input for tomorrow too: a module that runs across midnight UTC sees the scheduler start the new day's run, and
# a trigger with no logical date then takes tomorrow's partition.
TOMORROW = TODAY + dt.timedelta(days=1)


@pytest.fixture(scope="module")
def services(tmp_path_factory, demo_model_dir, request):
    tmp = tmp_path_factory.mktemp("rest_backfill")
    # Batches and commits of 2 rows: a shard of 5 commits 3 chunks, so a killed worker leaves some behind.
    pipelines, out, ids = write_test_pipeline(tmp, name=DAG_ID, days=[*DAYS, CLEAR_DAY], rows_per_day=ROWS_PER_DAY,
                                              num_shards=1, schedule="@daily", batch_size=2, commit_every_rows=2,
                                              start_date=TODAY - dt.timedelta(days=10))
    tomorrow = tmp / "in" / f"dt={TOMORROW}"   # today's rows again (the sample has rows for five days only)
    tomorrow.mkdir(parents=True)
    shutil.copy(tmp / "in" / f"dt={TODAY}" / "prompts.jsonl", tomorrow / "prompts.jsonl")
    ids[TOMORROW.isoformat()] = ids[TODAY.isoformat()]
    filter_day = tmp / "in" / f"dt={FILTER_DAY}"   # the first backfill day's rows again, in a partition of its own
    filter_day.mkdir(parents=True)
    shutil.copy(tmp / "in" / f"dt={DAYS[0]}" / "prompts.jsonl", filter_day / "prompts.jsonl")
    ids[FILTER_DAY.isoformat()] = ids[DAYS[0].isoformat()]
    # Shard workers die at a checkpoint only while the fault file asks for it (the Clear test writes it).
    fault = {"PYTHONPATH": str(FAULT_INJECTION), "BATCH_LLM_FAULT_FILE": str(tmp / "fault")}
    svc = AirflowServices(tmp, pipelines_dir=pipelines, extra_env=fault)
    svc.fault_file = tmp / "fault"
    failed_before = request.session.testsfailed
    try:
        svc.start()
        svc.wait_dag_parsed(DAG_ID)
        yield svc, out, ids
    finally:
        print_on_failure(request, svc, failed_before)
        killed = svc.stop()
        print(f"services: {svc.timings}; needed SIGKILL: {killed}")
        assert not svc.procs.leftovers(), "processes left behind"


def midnight(day: dt.date) -> str:
    return dt.datetime.combine(day, dt.time(), tzinfo=dt.timezone.utc).isoformat()


def partition(out: Path, day: str) -> Location:
    return Location(str(out)).child(DAG_ID, f"dt={day}")


def versions(part: Location) -> list[Path]:
    return sorted(p for p in part.path().iterdir() if p.name.startswith("v-"))


def check_partition(part: Location, *, run_id: str, expected_ids: list[str]) -> dict:
    """_CURRENT.json names this run's version; its data.jsonl has every input id exactly once."""
    current = read_json(part.child("_CURRENT.json").path())
    assert current["run_id"] == run_id, current
    version = Location(current["version"])
    assert version.path().is_dir(), current
    rows = list(iter_jsonl(version.child("data.jsonl").path()))
    got = [r["id"] for r in rows]
    assert sorted(got) == sorted(expected_ids) and len(got) == len(set(got)), (got, expected_ids)
    assert all(isinstance(r["output"], str) and r["output"].strip() for r in rows), rows
    summary = read_json(version.child("summary.json").path())
    assert summary["run_id"] == run_id and summary["rows_published"] == len(expected_ids), summary
    assert summary["partition"] == part.path().name
    assert current["rows"] == len(expected_ids)
    return current


def test_backfill_three_days_through_rest(services):
    svc, out, ids = services
    body = {"dag_id": DAG_ID, "from_date": midnight(DAYS[0]), "to_date": midnight(DAYS[-1]),
            "max_active_runs": 3, "reprocess_behavior": "none"}
    dry = svc.api("POST", "backfills/dry_run", json=body)
    planned = sorted(b["logical_date"][:10] for b in dry["backfills"])
    assert planned == [d.isoformat() for d in DAYS], dry

    # Created while the DAG is still paused (see the module docstring), then unpaused so that it runs.
    backfill = svc.api("POST", "backfills", json=body)
    svc.unpause(DAG_ID)

    runs = []
    deadline = time.monotonic() + 1200
    while time.monotonic() < deadline:
        runs = svc.dag_runs(DAG_ID, run_type="backfill")
        if len(runs) == 3 and all(r["state"] in ("success", "failed") for r in runs):
            break
        time.sleep(3)
    by_day = {r["logical_date"][:10]: r for r in runs}
    assert sorted(by_day) == [d.isoformat() for d in DAYS], runs
    for r in runs:
        if r["state"] != "success":
            pytest.fail(f"backfill run {r['dag_run_id']} is {r['state']}\n{svc.describe_run(DAG_ID, r['dag_run_id'])}")
    # The backfill's run for today took the slot of the catchup=False "latest" run: no scheduled run (but for a
    # day that began while the test ran, which the unpaused DAG then runs on its schedule).
    others = [r for r in svc.dag_runs(DAG_ID) if r["run_type"] != "backfill"]
    assert all(r["logical_date"][:10] > TODAY.isoformat() for r in others), others
    deadline = time.monotonic() + 60
    while not svc.api("GET", f"backfills/{backfill['id']}")["completed_at"] and time.monotonic() < deadline:
        time.sleep(2)
    assert svc.api("GET", f"backfills/{backfill['id']}")["completed_at"], "backfill not marked completed"

    # Three partitions, each written exactly once, by its own run.
    parts = sorted(p.name for p in (out / DAG_ID).iterdir() if p.name.startswith("dt=") and p.name <= f"dt={TODAY}")
    assert parts == [f"dt={d.isoformat()}" for d in DAYS], parts
    for day, run in by_day.items():
        part = partition(out, day)
        assert len(versions(part)) == 1, versions(part)
        current = check_partition(part, run_id=run["dag_run_id"], expected_ids=ids[day])
        assert Path(Location(current["version"]).path()) == versions(part)[0]

    # The inference task went through the gpu pool and queue; every task instance succeeded.
    tis = svc.task_instances(DAG_ID, by_day[DAYS[0].isoformat()]["dag_run_id"])
    infer = [t for t in tis if t["task_id"].endswith("batch_inference")]
    assert len(infer) == 1 and infer[0]["pool"] == "gpu" and infer[0]["queue"] == "gpu", infer
    assert {t["state"] for t in tis} == {"success"}, [(t["task_id"], t["state"]) for t in tis]
    # Its task log, as the scheduler's worker wrote it: the pipeline's messages and progress, and where the
    # engine's own output went (a file of the run's, which holds it)
    log = svc.task_log_files(DAG_ID, by_day[DAYS[0].isoformat()]["dag_run_id"], infer[0]["task_id"],
                             infer[0]["map_index"])[-1].read_text()
    assert re.search(r"progress: \d+/\d+ rows, [\d.]+ output tok/s, ETA", log), log[-2000:]
    engine_log = re.search(r"engine output: (/\S+?\.log)", log)
    assert engine_log and "engine transformers" in log, log[-2000:]
    assert Path(engine_log.group(1)).is_file() and "runs" in Path(engine_log.group(1)).parts
    svc.assert_loopback_only()


def test_trigger_without_logical_date_writes_run_after_partition(services):
    svc, out, ids = services
    run = svc.trigger(DAG_ID, logical_date=None)
    assert run["logical_date"] is None and run["run_after"], run
    svc.wait_run(DAG_ID, run["dag_run_id"], timeout=900)
    day = dt.datetime.fromisoformat(run["run_after"].replace("Z", "+00:00")).astimezone(dt.timezone.utc).date()
    part = partition(out, day.isoformat())
    current = check_partition(part, run_id=run["dag_run_id"], expected_ids=ids[day.isoformat()])
    # Today's partition was published by the backfill first: the pointer moved to the new version, and the
    # previous one is kept (publish keeps the current and the previous version). Past midnight the day is
    # tomorrow's, published before only if its scheduled run came first.
    published_before = [r for r in svc.dag_runs(DAG_ID) if r["dag_run_id"] != run["dag_run_id"]
                        and (r["logical_date"] or "")[:10] == day.isoformat() and r["state"] == "success"]
    assert len(versions(part)) == min(len(published_before) + 1, 2), versions(part)
    assert Path(Location(current["version"]).path()) in versions(part)
    svc.assert_loopback_only()


def test_clearing_a_failed_shard_resumes_it_and_the_run_succeeds(services):
    """The shard's worker is killed after its first commit in both tries (retries: 1): the task fails and the
    run with it. Clearing that one task with its downstream tasks (the UI's Clear on the failed task) re-runs it
    in the same run folder: it resumes from the rows its two tries committed, generates only the rest, and
    the tasks downstream publish all 5 rows once. Nothing upstream runs again."""
    svc, out, ids = services
    day = CLEAR_DAY.isoformat()
    # Only this run's shard dies (unpausing alone may start today's scheduled run beside it).
    svc.fault_file.write_text(f"after_commit 2 dt={day}\n")
    svc.unpause(DAG_ID)   # (the backfill test unpaused it already when the whole module runs)
    run = svc.trigger(DAG_ID, logical_date=midnight(CLEAR_DAY))
    run_id = run["dag_run_id"]
    with pytest.raises(AssertionError, match="is 'failed'"):
        svc.wait_run(DAG_ID, run_id, timeout=900)
    assert svc.fault_file.read_text().split()[:2] == ["after_commit", "0"], "both tries should have been killed"
    before = {(t["task_id"], t["map_index"]): t for t in svc.task_instances(DAG_ID, run_id)}
    (shard_key,) = [k for k, t in before.items() if k[0].endswith("batch_inference")]
    assert before[shard_key]["state"] == "failed" and before[shard_key]["try_number"] == 2, before[shard_key]

    cleared = svc.api("POST", f"dags/{DAG_ID}/clearTaskInstances", json={
        "dry_run": False, "dag_run_id": run_id, "task_ids": [list(shard_key)], "only_failed": True,
        "include_downstream": True, "reset_dag_runs": True})
    assert shard_key[0] in {t["task_id"] for t in cleared["task_instances"]}, cleared
    svc.wait_run(DAG_ID, run_id, timeout=900)

    after = {(t["task_id"], t["map_index"]): t for t in svc.task_instances(DAG_ID, run_id)}
    assert {t["state"] for t in after.values()} == {"success"}, after
    assert after[shard_key]["try_number"] == 3
    upstream = [k for k in before if k[0].split(".")[-1] in ("fetch_model", "quantize", "plan_shards")]
    assert len(upstream) == 3, sorted(before)
    for k in upstream:   # ran once, in the first attempt of the run, and not again
        assert after[k]["try_number"] == 1 and after[k]["end_date"] == before[k]["end_date"], (k, after[k])
    logs = svc.task_log_files(DAG_ID, run_id, shard_key[0], shard_key[1])
    assert len(logs) == 3, logs
    resumed = [int(m) for m in re.findall(r"resuming shard 0: (\d+) rows already committed", logs[-1].read_text())]
    assert len(resumed) == 1 and 1 <= resumed[0] < ROWS_PER_DAY, (resumed, logs[-1].read_text()[-4000:])
    check_partition(partition(out, day), run_id=run_id, expected_ids=ids[day])
    svc.assert_loopback_only()


def test_clearing_one_shards_filter_redoes_that_part_only(services):
    """A run in two shards (the trigger's ``num_shards``), then the Clear of ``filter_shard`` of shard 1 with its
    downstream tasks: that shard's part is filtered again and the join, evaluate and publish run again, while
    shard 0's filter and both shards' inference keep their first try, and shard 0's part its first pass."""
    svc, out, ids = services
    day = FILTER_DAY.isoformat()
    svc.unpause(DAG_ID)
    run = svc.trigger(DAG_ID, logical_date=midnight(FILTER_DAY), conf={"num_shards": 2})
    run_id = run["dag_run_id"]
    svc.wait_run(DAG_ID, run_id, timeout=900)
    before = {(t["task_id"].split(".")[-1], t["map_index"]): t for t in svc.task_instances(DAG_ID, run_id)}
    assert {k for k in before if k[0] == "filter_shard"} == {("filter_shard", 0), ("filter_shard", 1)}, sorted(before)
    run_dir = Location(str(out)).child(DAG_ID, "runs", f"dt={day}", re.sub(r"[^A-Za-z0-9_.-]", "_", run_id), "filter")
    parts = {i: read_json(run_dir.child(f"shard-0000{i}", "manifest.json").path()) for i in (0, 1)}
    joined = read_json(run_dir.child("manifest.json").path())
    assert [p["shard"] for p in joined["parts"]] == [0, 1] and joined["rows"] == sum(p["rows"] for p in parts.values())

    task_id = before[("filter_shard", 1)]["task_id"]
    svc.api("POST", f"dags/{DAG_ID}/clearTaskInstances", json={
        "dry_run": False, "dag_run_id": run_id, "task_ids": [[task_id, 1]], "only_failed": False,
        "include_downstream": True, "reset_dag_runs": True})
    svc.wait_run(DAG_ID, run_id, timeout=900)
    after = {(t["task_id"].split(".")[-1], t["map_index"]): t for t in svc.task_instances(DAG_ID, run_id)}
    assert {t["state"] for t in after.values()} == {"success"}, after
    again = {k for k in after if after[k]["try_number"] > before[k]["try_number"]}
    assert again == {("filter_shard", 1), ("content_filter", -1), ("evaluate", -1), ("publish", -1)}, again
    assert read_json(run_dir.child("shard-00000", "manifest.json").path())["generation"] == parts[0]["generation"]
    assert read_json(run_dir.child("shard-00001", "manifest.json").path())["generation"] != parts[1]["generation"]
    check_partition(partition(out, day), run_id=run_id, expected_ids=ids[day])
