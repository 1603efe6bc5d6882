"""What a publish may delete, on a real S3 server (SeaweedFS on loopback): only proven versions of its own
partition; a conditional PUT whose reply was lost, retried and refused with a real 412, still ends on the run's
version; orphans go after their grace period. (The local-folder variants: tests/unit/test_publish_retention.py.)"""
from __future__ import annotations

import json
import time
import uuid

import batch_llm.analysis.report as report
import pytest
from batch_llm.api import publish
from batch_llm.io.current_pointer import read_pointer
from batch_llm.io.retention import VERSION_MARKER, Partition
from batch_llm.io.storage import Location, exists, write_json
from publish_runs import PARTITION, PIPELINE, has_data, partition, ready_to_publish


@pytest.fixture()
def root(request, s3, tmp_path, monkeypatch) -> Location:
    monkeypatch.chdir(tmp_path)   # an empty or relative URL in a pointer resolves here: a regression deletes nothing else
    return Location(f"s3://{s3.bucket}/retention-{request.node.name[:40]}-{uuid.uuid4().hex[:12]}", s3.storage_options())


def _pointer(root: Location):
    return read_pointer(partition(root).child("_CURRENT.json").path())


def test_a_pointer_whose_history_names_other_data_gets_none_of_it_deleted(root, s3):
    first = publish(*ready_to_publish(root, "r1"))
    part = partition(root)
    precious = Location(f"s3://{s3.bucket}/precious-{uuid.uuid4().hex[:12]}", root.options)
    write_json(precious.child("data.json").path(), {"keep": 1})
    other = Location(publish(*ready_to_publish(root, "o1", part="dt=2026-12-04")).version, root.options)
    bare = part.child("v-20261203T000000000000-x-abcdef")
    write_json(bare.child("data.jsonl").path(), {"keep": 1})
    named = [precious.url, root.url, part.url, other.url, bare.url,
             part.child("..", "dt=2026-12-04", other.url.rsplit("/", 1)[-1]).url, "", None]
    pointer = part.child("_CURRENT.json").path()
    pointer.fs.pipe_file(pointer.path, json.dumps({**_pointer(root).value, "history": named}).encode())

    second = publish(*ready_to_publish(root, "r2"))
    assert exists(precious.child("data.json").path()) and has_data(other.url, root)
    assert exists(bare.child("data.jsonl").path()) and has_data(second.version, root) and has_data(first.version, root)
    publish(*ready_to_publish(root, "r3"))
    assert not has_data(first.version, root)   # a real version two switches old is still retired


@pytest.mark.parametrize("others", [0, 1, 2])
def test_a_conditional_put_retried_after_a_lost_reply_ends_on_a_version_that_exists(root, monkeypatch, others):
    """Run A's PUT of the pointer lands, its reply is lost; ``others`` runs publish; the client sends the PUT
    again and the store answers 412. Before, A took the 412 for another run's switch: it put its own version
    into its own history (others=0) or switched to its version after the others had retired it."""
    publish(*ready_to_publish(root, "p0"))
    p1 = publish(*ready_to_publish(root, "p1")).version
    runs = [ready_to_publish(root, f"b{i}") for i in range(others)]
    fs = partition(root).path().fs   # fsspec caches it: the pointer's writes go through this instance
    real = fs.pipe_file
    armed = [True]

    def put_retried_after_lost_reply(path, value, **kwargs):
        out = real(path, value, **kwargs)
        if armed[0] and path.endswith("/_CURRENT.json"):
            armed[0] = False
            for run in runs:
                publish(*run)
            return real(path, value, **kwargs)   # the client's retry: the condition no longer holds
        return out

    monkeypatch.setattr(fs, "pipe_file", put_retried_after_lost_reply)
    a = publish(*ready_to_publish(root, "a"))
    assert not armed[0]
    current = _pointer(root)
    assert has_data(current.version, root) and all(has_data(v, root) for v in current.history)
    assert current.version not in current.history and a.replaced == p1 and current.seq == 3 + others
    assert current.value["run_id"] == (f"b{others - 1}" if others else "a")
    if others < 2:   # A is current or the previous; two switches later it is retired, as any version
        assert current.history == [a.version if others else p1]


class Killed(BaseException):
    """The publisher's process ended (as by SIGKILL: nothing after this point of publish runs)."""


def test_orphans_past_their_grace_are_swept_and_nothing_else(root, monkeypatch):
    grace = {"orphan_grace_hours": 3 / 3600}   # 3 s (the store's clock counts whole seconds)
    publish(*ready_to_publish(root, "r1", **grace))
    v2 = publish(*ready_to_publish(root, "r2", **grace)).version
    real = report.write_run_report

    def killed(summary, version, pipeline_root):
        raise Killed(version.url)

    with monkeypatch.context() as m:
        m.setattr(report, "write_run_report", killed)
        with pytest.raises(Killed) as e:
            publish(*ready_to_publish(root, "old", **grace))
    old = str(e.value.args[0])
    legacy = partition(root).child("v-20261101T000000000000-legacy-abcdef")   # no marker: never proven
    write_json(legacy.child("data.jsonl").path(), {})
    time.sleep(5)
    part = Partition(partition(root), PIPELINE, PARTITION)
    young = partition(root).child("v-20261203T000000000000-young-abcdef")

    def another_run_writing(summary, version, pipeline_root):   # a version younger than the grace at the sweep
        part.write_marker(young, "young")
        write_json(young.child("data.jsonl").path(), {})
        return real(summary, version, pipeline_root)

    monkeypatch.setattr(report, "write_run_report", another_run_writing)
    v3 = publish(*ready_to_publish(root, "r3", **grace)).version
    assert not has_data(old, root) and not exists(Location(old, root.options).child(VERSION_MARKER).path())
    assert has_data(young.url, root) and exists(legacy.child("data.jsonl").path())
    assert _pointer(root).history == [v2] and has_data(v2, root) and has_data(v3, root)
