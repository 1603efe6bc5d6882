"""The plan in parts (``sharding.plan_part_bytes``) under a real scheduler (api-server, scheduler, dag-processor,
LocalExecutor), driven through the REST API: a day of three files runs as plan_parts → plan_scan × 3 → plan_join →
plan_write × 3 → plan_shards and publishes every valid row once (a duplicate id across files reported once); then a
row lands late in the last file and the Clear of that part's ``plan_scan`` with its downstream tasks scans that part
alone again: the other parts' scans keep their first try, their shards keep their inference, and the new row is
published."""
from __future__ import annotations

import datetime as dt
import json
import re

import pytest
import yaml
from airflow_services import AirflowServices, print_on_failure, write_test_pipeline
from batch_llm.io.storage import Location, iter_jsonl, read_json

pytestmark = pytest.mark.slow

DAG_ID = "plan_parts_demo"
DAY = dt.datetime.now(dt.timezone.utc).date() - dt.timedelta(days=3)


@pytest.fixture(scope="module")
def services(tmp_path_factory, demo_model_dir, request):
    tmp = tmp_path_factory.mktemp("plan_parts")
    pipelines, out, ids = write_test_pipeline(tmp, name=DAG_ID, days=[DAY], rows_per_day=6, num_shards=1,
                                              schedule=None, start_date=DAY - dt.timedelta(days=10),
                                              evaluate=False, batch_size=4, commit_every_rows=4)
    folder = tmp / "in" / f"dt={DAY}"
    rows = [json.loads(ln) for ln in (folder / "prompts.jsonl").read_text().splitlines()]
    (folder / "prompts.jsonl").unlink()
    files = [rows[0:2], rows[2:4] + [rows[0]], rows[4:6]]  # the second file repeats the first file's first id
    for n, chunk in enumerate(files):
        (folder / f"part-{n}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chunk))
    path = pipelines / f"{DAG_ID}.yaml"
    cfg = yaml.safe_load(path.read_text())
    cfg["input"]["path"] = str(tmp / "in" / "dt={ds}")
    cfg["output"]["parts"] = True
    part_bytes = max(f.stat().st_size for f in folder.iterdir())
    cfg["sharding"] = {"rows_per_shard": 2, "plan_part_bytes": part_bytes}  # one part a file
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    svc = AirflowServices(tmp, pipelines_dir=pipelines)
    failed_before = request.session.testsfailed
    try:
        svc.start()
        svc.wait_dag_parsed(DAG_ID)
        yield svc, out, folder, rows
    finally:
        print_on_failure(request, svc, failed_before)
        svc.stop()
        assert not svc.procs.leftovers(), "processes left behind"


def _published(out, run_id) -> list[dict]:
    part = Location(str(out)).child(DAG_ID, f"dt={DAY}")
    current = read_json(part.child("_CURRENT.json").path())
    assert current["run_id"] == run_id, current
    data = Location(current["version"]).child("data")
    return [r for f in sorted(data.path().iterdir()) for r in iter_jsonl(f)]


def test_the_plan_runs_in_parts_and_a_cleared_part_alone_is_scanned_again(services):
    svc, out, folder, rows = services
    svc.unpause(DAG_ID)
    run_id = svc.trigger(DAG_ID, logical_date=f"{DAY}T00:00:00+00:00")["dag_run_id"]
    svc.wait_run(DAG_ID, run_id, timeout=900)
    before = {(t["task_id"].split(".")[-1], t["map_index"]): t for t in svc.task_instances(DAG_ID, run_id)}
    assert {k for k in before if k[0] in ("plan_scan", "plan_write")} == {
        (name, i) for name in ("plan_scan", "plan_write") for i in range(3)}, sorted(before)
    got = _published(out, run_id)
    assert sorted(r["id"] for r in got) == sorted(r["id"] for r in rows)  # each id once: the repeat is an error
    run_dir = Location(str(out)).child(DAG_ID, "runs", f"dt={DAY}", re.sub(r"[^A-Za-z0-9_.-]", "_", run_id))
    plan = read_json(run_dir.child("plan", "manifest.json").path())
    assert (plan["parts"], plan["duplicates"], plan["valid"]) == (3, 1, 6), plan
    scans = {i: read_json(run_dir.child("plan", "parts", f"part-0000{i}", "manifest.json").path()) for i in range(3)}
    infer_mtimes = {s["index"]: run_dir.child("infer", f"shard-{s['index']:05d}", "manifest.json").path().stat().st_mtime_ns
                    for s in plan["shards"]}
    last_part_shards = {s["index"] for s in plan["shards"]} - {s["index"] for s in plan["shards"][:-1]}

    late = {**rows[0], "id": "late-row"}
    with open(folder / "part-2.jsonl", "a") as fh:
        fh.write(json.dumps(late) + "\n")
    task_id = before[("plan_scan", 2)]["task_id"]
    svc.api("POST", f"dags/{DAG_ID}/clearTaskInstances", json={
        "dry_run": False, "dag_run_id": run_id, "task_ids": [[task_id, 2]], "only_failed": False,
        "include_downstream": True, "reset_dag_runs": True})
    svc.wait_run(DAG_ID, run_id, timeout=900)
    after = {(t["task_id"].split(".")[-1], t["map_index"]): t for t in svc.task_instances(DAG_ID, run_id)}
    assert {t["state"] for t in after.values()} == {"success"}, after
    again = {k for k in after if k in before and after[k]["try_number"] > before[k]["try_number"]}
    assert ("plan_scan", 0) not in again and ("plan_scan", 1) not in again and ("plan_scan", 2) in again, again
    now = {i: read_json(run_dir.child("plan", "parts", f"part-0000{i}", "manifest.json").path()) for i in range(3)}
    assert now[0] == scans[0] and now[1] == scans[1] and now[2]["rows_read"] == scans[2]["rows_read"] + 1
    plan2 = read_json(run_dir.child("plan", "manifest.json").path())
    kept = [s for s in plan2["shards"] if s["index"] not in last_part_shards and s in plan["shards"]]
    assert kept, (plan["shards"], plan2["shards"])
    for s in kept:  # their inference was not redone: the committed shard was found and returned
        path = run_dir.child("infer", f"shard-{s['index']:05d}", "manifest.json").path()
        assert path.stat().st_mtime_ns == infer_mtimes[s["index"]], s
    got = _published(out, run_id)
    assert sorted(r["id"] for r in got) == sorted([r["id"] for r in rows] + ["late-row"])
    svc.assert_loopback_only()
