"""What a publish may delete, on a local folder: only versions of its own partition proven by their marker, name and
place; a pointer switch whose reply was lost still ends on the run's version; orphans of killed publishers go after
their grace period. (The same on the S3 server: tests/system/test_publish_retention_s3.py.)"""
from __future__ import annotations

import json
import os
import shutil
import time

import batch_llm.analysis.report as report
import batch_llm.io.current_pointer as current_pointer
import pytest
from batch_llm.api import publish
from batch_llm.io.current_pointer import PointerConflict, read_pointer
from batch_llm.io.retention import VERSION_MARKER, VersionGone
from batch_llm.io.storage import Location, exists, write_json
from publish_runs import has_data, partition, ready_to_publish


@pytest.fixture()
def root(tmp_path, monkeypatch) -> Location:
    # Relative and empty URLs resolve against the working directory: this test's own folder, so that a
    # regression deletes nothing outside it.
    monkeypatch.chdir(tmp_path)
    return Location(str(tmp_path / "out"))


def _pointer(root: Location):
    return read_pointer(partition(root).child("_CURRENT.json").path())


def _age(folder: str, seconds: float) -> None:
    """Makes every file under ``folder`` (or the file itself) look last changed ``seconds`` ago."""
    t = time.time() - seconds
    paths = [folder] if os.path.isfile(folder) else [os.path.join(d, f) for d, _, fs in os.walk(folder) for f in fs]
    for p in paths:
        os.utime(p, (t, t))


def test_a_pointer_whose_history_names_other_data_gets_none_of_it_deleted(root, tmp_path):
    """A pointer edited (or corrupted) to name any prefix in its history: the next publish deletes none of it,
    only versions proven by their marker. Before, publish removed every URL the history named."""
    first = publish(*ready_to_publish(root, "r1"))
    part = partition(root)
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "data.txt").write_text("keep me")
    # a version of another partition of the pipeline (its marker is real, its place is not this partition's)
    other = Location(publish(*ready_to_publish(root, "o1", part="dt=2026-12-04")).version)
    # in this partition: a version-named folder without a marker, and one whose marker names another version
    bare = part.child("v-20261203T000000000000-x-abcdef")
    write_json(bare.child("data.jsonl").path(), {"keep": 1})
    forged = part.child("v-20261203T000000000001-x-abcdef")
    write_json(forged.child(VERSION_MARKER).path(), {"pipeline": "race", "partition": "dt=2026-12-03",
                                                     "version": first.version.rsplit("/", 1)[-1]})
    named = [str(precious), f"file://{precious}", "precious", root.url, part.url, other.url, bare.url, forged.url,
             part.child("..", "dt=2026-12-04", other.url.rsplit("/", 1)[-1]).url, "", 7, None]
    pointer = part.child("_CURRENT.json").path()
    pointer.write_text(json.dumps({**_pointer(root).value, "history": named}))

    second = publish(*ready_to_publish(root, "r2"))
    assert (precious / "data.txt").read_text() == "keep me"
    assert has_data(other.url, root) and exists(bare.child("data.jsonl").path())
    assert exists(forged.child(VERSION_MARKER).path()) and has_data(second.version, root)
    assert has_data(first.version, root)   # the version the edited pointer named as current is now the previous
    # A history that names a real version of this partition still retires it, two switches old.
    publish(*ready_to_publish(root, "r3"))
    assert not exists(Location(first.version).path())


def _lost_reply(monkeypatch, between=()):
    """Pointer writes of the next switch land, then report a conflict, as an S3 PUT retried by the client
    after a lost reply gets 412; the runs in ``between`` publish in that gap."""
    real = current_pointer.write_pointer
    armed = [True]

    def lands_then_conflict(path, expected, value):
        real(path, expected, value)
        if armed[0]:
            armed[0] = False
            for run in between:
                publish(*run)
            raise PointerConflict(str(path))

    monkeypatch.setattr(current_pointer, "write_pointer", lands_then_conflict)


def test_a_switch_whose_reply_was_lost_ends_on_its_own_version(root, monkeypatch):
    """Before, the retry switched from its own version: current in its own history, the real previous deleted."""
    v1 = publish(*ready_to_publish(root, "r1")).version
    _lost_reply(monkeypatch)
    m2 = publish(*ready_to_publish(root, "r2"))
    current = _pointer(root)
    assert current.version == m2.version and current.history == [v1] and m2.replaced == v1
    assert current.seq == 2 and has_data(v1, root)
    v3 = publish(*ready_to_publish(root, "r3")).version
    assert _pointer(root).history == [m2.version] and has_data(m2.version, root) and has_data(v3, root)


@pytest.mark.parametrize("others", [1, 2])
def test_a_lost_reply_with_other_publishers_in_between_never_ends_on_a_deleted_version(root, monkeypatch, others):
    """Run A's switch lands, its reply is lost, and 1 or 2 other runs publish before A reads the pointer again.
    Before, A switched back to its own version after they had retired it: the pointer named a deleted folder."""
    publish(*ready_to_publish(root, "p0"))
    publish(*ready_to_publish(root, "p1"))
    runs = [ready_to_publish(root, f"b{i}") for i in range(others)]
    _lost_reply(monkeypatch, between=runs)
    p1 = _pointer(root).version
    a = publish(*ready_to_publish(root, "a"))
    current = _pointer(root)
    assert has_data(current.version, root) and all(has_data(v, root) for v in current.history)
    assert current.value["run_id"] == f"b{others - 1}"
    assert a.replaced == p1 and current.history == ([a.version] if others == 1 else [current.history[0]])
    assert current.version not in current.history and current.seq == 3 + others


def test_a_publisher_whose_version_was_removed_before_its_switch_does_not_switch(root, monkeypatch):
    """A publisher stalled past the grace period finds its version swept: it fails instead of pointing the
    partition at a deleted folder."""
    v1 = publish(*ready_to_publish(root, "r1")).version
    real = report.write_run_report

    def swept_meanwhile(summary, version, pipeline_root):
        url = real(summary, version, pipeline_root)
        shutil.rmtree(version.path())
        return url

    monkeypatch.setattr(report, "write_run_report", swept_meanwhile)
    with pytest.raises(VersionGone, match="removed before its pointer switch"):
        publish(*ready_to_publish(root, "r2"))
    assert _pointer(root).version == v1


class Killed(BaseException):
    """The publisher's process ended (as by SIGKILL: nothing after this point of publish runs)."""


def _killed_publish(root: Location, run_id: str, monkeypatch) -> str:
    """A publisher killed after writing its data and summary, before its switch: the version it leaves."""
    def killed(summary, version, pipeline_root):
        raise Killed(version.url)

    with monkeypatch.context() as m:
        m.setattr(report, "write_run_report", killed)
        with pytest.raises(Killed) as e:
            publish(*ready_to_publish(root, run_id))
    return str(e.value.args[0])


def test_orphans_past_their_grace_are_swept_and_nothing_else(root, monkeypatch):
    """output.orphan_grace_hours: 1. Before, nothing removed killed publishers' versions or temporary files."""
    v1 = publish(*ready_to_publish(root, "r1", orphan_grace_hours=1)).version
    v2 = publish(*ready_to_publish(root, "r2", orphan_grace_hours=1)).version
    old, young = _killed_publish(root, "old", monkeypatch), _killed_publish(root, "young", monkeypatch)
    part = partition(root).path()
    for v in (old, v1, v2):
        _age(v, 2 * 3600)                   # the current and previous versions are as old as the orphan
    _age(young, 1800)
    old_tmp, young_tmp = part / "._CURRENT.json.0a1b2c3d.tmp", part / "._CURRENT.json.4e5f6a7b.tmp"
    old_tmp.write_text("{")
    young_tmp.write_text("{")
    _age(str(old_tmp), 2 * 3600)
    legacy = part / "v-20261101T000000000000-legacy-abcdef"   # a version from before the marker: not proven
    legacy.mkdir()
    (legacy / "data.jsonl").write_text("{}\n")
    _age(str(legacy), 30 * 86400)

    v3 = publish(*ready_to_publish(root, "r3", orphan_grace_hours=1)).version
    assert not exists(Location(old).path()) and not exists(old_tmp)
    assert has_data(young, root) and exists(young_tmp) and exists(legacy / "data.jsonl")
    assert _pointer(root).history == [v2] and has_data(v2, root) and has_data(v3, root)
    assert not exists(Location(v1).path())   # retired: two switches old
