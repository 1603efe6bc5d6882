"""Two runs of one partition publishing at once, on a local folder and on a real S3 server (SeaweedFS on loopback).

The guarantees: at most one current version; a published version never changes or disappears while it is current
(or the previous one); a version is never deleted while another run is still writing it; no pointer switch is lost.
"""
from __future__ import annotations

import threading
import uuid

import pytest
from batch_llm.api import publish
from batch_llm.io.current_pointer import PointerConflict, read_pointer, switch_pointer, write_pointer
from batch_llm.io.storage import Location, exists, iter_jsonl, list_files
from publish_runs import IDS, ready_to_publish


@pytest.fixture(params=["local", "s3"])
def output_root(request, tmp_path) -> Location:
    if request.param == "local":
        return Location(str(tmp_path / "out"))
    s3 = request.getfixturevalue("s3")
    return Location(f"s3://{s3.bucket}/race-{request.node.name.split('[')[0][-20:]}-{uuid.uuid4().hex[:12]}",
                    s3.storage_options())


def _versions(root: Location) -> set[str]:
    """Version folders that hold a summary (SeaweedFS lists a removed folder's empty directory; S3 would not)."""
    part = root.child("race", "dt=2026-12-03")
    return {p.name for p in list_files(part.path()) if p.name.startswith("v-") and exists(p / "summary.json")}


def test_a_slow_publisher_keeps_its_version_while_two_others_publish(output_root, monkeypatch):
    """Run A writes its version slowly; meanwhile runs B1 and B2 publish the same day. A's version is not
    deleted under it, A then becomes current with all its rows, and retention removed only B1 (a version that
    was current once and is now two switches old). Before the compare-and-swap and the history, B1's publish
    deleted every version but its own and the previous one: A's, half written."""
    import batch_llm.analysis.report as report

    a_wrote_summary, others_done = threading.Event(), threading.Event()
    real = report.write_run_report

    def slow_for_a(summary, version, pipeline_root):
        if summary.run_id == "A":
            a_wrote_summary.set()
            assert others_done.wait(120), "B1/B2 did not finish"
        return real(summary, version, pipeline_root)

    monkeypatch.setattr(report, "write_run_report", slow_for_a)
    results: dict[str, object] = {}

    def publish_run(run_id):
        try:
            results[run_id] = publish(*ready_to_publish(output_root, run_id))
        except BaseException as e:  # noqa: BLE001 - reported by the assertions below
            results[run_id] = e

    a = threading.Thread(target=publish_run, args=("A",))
    a.start()
    assert a_wrote_summary.wait(120)
    publish_run("B1")
    publish_run("B2")
    others_done.set()
    a.join(120)
    for run_id, r in results.items():
        assert not isinstance(r, BaseException), (run_id, r)
    part = output_root.child("race", "dt=2026-12-03")
    current = read_pointer(part.child("_CURRENT.json").path())
    va, vb1, vb2 = (results[k].version for k in ("A", "B1", "B2"))
    assert current.version == va and current.seq == 3 and current.value["run_id"] == "A"
    rows = list(iter_jsonl(Location(va, output_root.options).child("data.jsonl").path()))
    assert [r["id"] for r in rows] == IDS and all(r["output"] == "answer of A" for r in rows)
    assert current.history == [vb2] and results["A"].replaced == vb2 and results["B2"].replaced == vb1
    assert _versions(output_root) == {va.rsplit("/", 1)[-1], vb2.rsplit("/", 1)[-1]}


def test_a_retried_publish_of_the_same_filter_pass_publishes_nothing_new(output_root):
    cfg, layout, plan, filtered, scores = ready_to_publish(output_root, "R")
    first = publish(cfg, layout, plan, filtered, scores)
    again = publish(cfg, layout, plan, filtered, scores)
    assert again == first and len(_versions(output_root)) == 1
    # A new pass of the filter (a Clear of content_filter and its downstream tasks) is a new version.
    refiltered = filtered.model_copy(update={"generation": "another-pass"})
    second = publish(cfg, layout, plan, refiltered, scores)
    assert second.version != first.version and second.replaced == first.version
    assert exists(Location(first.version, output_root.options).child("data.jsonl").path())


def test_no_pointer_switch_is_lost(output_root):
    """Four threads switch one pointer 6 times each: every switch lands once, in one order (seq 1..24, each
    replacing the one before), never two from the same state."""
    pointer = output_root.child("race", "dt=2026-12-03", "_CURRENT.json").path()
    replaced: list[int] = []
    lock = threading.Lock()

    def worker(n):
        for i in range(6):
            state, value = switch_pointer(pointer, lambda st, v=f"v-{n}-{i}": {"version": v, "seq": st.seq + 1})
            with lock:
                replaced.append(state.seq)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert sorted(replaced) == list(range(24))
    assert read_pointer(pointer).seq == 24


def test_a_write_from_a_stale_read_is_refused(output_root):
    pointer = output_root.child("race", "dt=2026-12-03", "_CURRENT.json").path()
    empty = read_pointer(pointer)
    write_pointer(pointer, empty, {"version": "v-1"})
    with pytest.raises(PointerConflict):
        write_pointer(pointer, empty, {"version": "v-2"})   # "create" when one exists
    first = read_pointer(pointer)
    write_pointer(pointer, first, {"version": "v-3"})
    with pytest.raises(PointerConflict):
        write_pointer(pointer, first, {"version": "v-4"})   # replaced since it was read
    assert read_pointer(pointer).version == "v-3"
