"""``io.storage.atomic_writer`` on a local disk: a failure mid-write leaves neither the file nor a temporary one,
concurrent writers of one path never interleave, a reader sees the old whole file or the new whole file. The
same against S3: ``tests/system/test_s3_pipeline.py``. And why the local path is not fsspec's deferred file."""
from __future__ import annotations

import os
import tempfile
import threading

import fsspec
import pytest
from batch_llm.io.storage import as_path, atomic_writer, write_bytes_atomic, write_jsonl
from helpers import race


def test_a_failure_mid_write_leaves_nothing(tmp_path):
    target = tmp_path / "out" / "data.bin"
    with pytest.raises(RuntimeError, match="mid-write"):
        with atomic_writer(as_path(str(target))) as w:
            w.write(b"x" * 100_000)
            w.flush()
            assert os.listdir(target.parent) and not target.exists()  # only the hidden temporary file so far
            raise RuntimeError("the source broke mid-write")
    assert os.listdir(target.parent) == []


def test_a_failed_rewrite_keeps_the_old_file_whole(tmp_path):
    target = tmp_path / "rows.jsonl"
    write_jsonl(as_path(str(target)), ({"i": i} for i in range(3)))
    before = target.read_bytes()

    def rows():
        yield from ({"i": i, "pad": "p" * 1000} for i in range(200))
        raise OSError("gone")

    with pytest.raises(OSError, match="gone"):
        write_jsonl(as_path(str(target)), rows())
    assert target.read_bytes() == before and os.listdir(tmp_path) == ["rows.jsonl"]


def test_concurrent_writers_never_interleave_and_readers_see_whole_files(tmp_path):
    target = as_path(str(tmp_path / "shared.bin"))
    size = 1 << 20
    contents = [bytes([65 + k]) * size for k in range(6)]
    seen: list[bytes] = []

    def writer(k: int) -> None:
        for _ in range(5):
            with atomic_writer(target) as w:
                for i in range(0, size, 4096):  # many small writes, so that two writers overlap in time
                    w.write(contents[k][i:i + 4096])

    def reader(stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                seen.append(open(target.path, "rb").read())
            except FileNotFoundError:
                pass

    race(writer, len(contents), reader)
    assert seen, "the reader never saw the file"
    assert all(s in contents for s in seen), {(len(s), s[:1], s[-1:]) for s in seen if s not in contents}
    assert open(target.path, "rb").read() in contents
    assert os.listdir(tmp_path) == ["shared.bin"]  # no temporary file left by any writer


def test_fsspec_local_deferred_file_is_not_beside_its_target(tmp_path):
    """Why ``AtomicWriter`` keeps its own local temporary file: fsspec's ``autocommit=False`` local file is made
    in the system temporary folder and moved at commit, a copy (visible half-written) across file systems. When
    fsspec makes it beside the target, this fails, and the local path can become fsspec's as well."""
    f = fsspec.filesystem("file").open(str(tmp_path / "x.bin"), "wb", autocommit=False)
    try:
        assert os.path.dirname(f.temp) == tempfile.gettempdir() != str(tmp_path)
    finally:
        f.close()
        f.discard()


def test_a_whole_write_replaces_the_file(tmp_path):
    target = as_path(str(tmp_path / "a" / "b.txt"))
    write_bytes_atomic(target, b"one")
    write_bytes_atomic(target, b"two")
    assert open(target.path, "rb").read() == b"two" and os.listdir(tmp_path / "a") == ["b.txt"]
