"""Inputs the planner cannot read as files, and lines past ``input.max_line_bytes``: a local input that is not a
regular file (a FIFO, a device, a socket) is refused by name before it is opened; an over-long line is that line's
error with its line number, skipped in bounded memory, and the lines around it are planned."""
from __future__ import annotations

import io
import json
import os
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from batch_llm.io.formats import InputFileError, bounded_lines, read_file_rows
from batch_llm.io.storage import Location, iter_jsonl
from batch_llm.stages import plan as plan_mod
from helpers import demo_config
from upath import UPath

TESTS = Path(__file__).resolve().parents[1]


def _plan(tmp_path: Path, src: Path, **over):
    cfg = demo_config(tmp_path, input__path=str(src), **over)
    m = plan_mod.write_plan(cfg, input_loc=Location(str(src)), plan_dir=Location(str(tmp_path / "plan")))
    rows = {r["id"] for s in m.shards for r in iter_jsonl(Location(s.url).path())}
    return m, rows, list(iter_jsonl(Location(m.errors).path()))


@pytest.mark.timeout(30, method="signal")  # reading a FIFO would block until a writer came
def test_an_input_that_is_not_a_regular_file_is_refused_by_name_before_it_is_opened(tmp_path):
    fifo = tmp_path / "prompts.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(InputFileError, match=rf"{re.escape(str(fifo))}: the input is a FIFO \(named pipe\), not a regular file"):
        _plan(tmp_path, fifo)
    with pytest.raises(InputFileError, match="/dev/zero: the input is a character device"):
        _plan(tmp_path, Path("/dev/zero"), input__format="jsonl")
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.jsonl").write_text('{"id": "a", "prompt": "hi"}\n')
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(folder / "b.jsonl"))
        with pytest.raises(InputFileError, match=rf"{re.escape(str(folder / 'b.jsonl'))}: the input is a socket"):
            _plan(tmp_path, folder)


def test_lines_past_the_limit_are_skipped_without_being_held():
    """A local file's lines and an object store's (an fsspec file, which reads lines whole unless wrapped): the
    limit counts a line without its newline; the last line may have none."""
    from fsspec.spec import AbstractBufferedFile, AbstractFileSystem

    data = b"ab\n" + b"x" * 10 + b"\n" + b"y" * 11 + b"\n\nz" + b"w" * 30
    expected = [b"ab\n", b"x" * 10 + b"\n", None, b"\n", None]
    assert list(bounded_lines(io.BytesIO(data), 10)) == expected
    assert list(bounded_lines(io.BytesIO(b"1234567890"), 10)) == [b"1234567890"]

    class StoreFile(AbstractBufferedFile):
        def _fetch_range(self, start, end):
            return data[start:end]

    stored = StoreFile(AbstractFileSystem(), "bucket/in.jsonl", mode="rb", size=len(data), block_size=4)
    assert list(bounded_lines(stored, 10)) == expected


def test_an_over_long_jsonl_line_is_its_own_error_with_its_line_number(tmp_path):
    src = tmp_path / "in.jsonl"
    long = json.dumps({"id": "long", "prompt": "x" * 5000})
    src.write_text(f'{{"id": "a", "prompt": "hi"}}\n{long}\n\n{{"id": "b", "prompt": "hi"}}\n')
    m, rows, errors = _plan(tmp_path, src, input__max_line_bytes=1000)
    assert rows == {"a", "b"} and m.invalid == 1
    assert errors == [{"source": "in.jsonl", "line": 2, "id": None, "reason": "the line is longer than 1000 bytes "
                       "(input.max_line_bytes); skipped without being read"}]


def test_an_over_long_openai_batch_first_line_leaves_the_format_to_the_next_line(tmp_path):
    src = tmp_path / "batch.jsonl"
    lines = [{"custom_id": c, "body": {"messages": [{"role": "user", "content": t}]}} for c, t in
             (("long", "x" * 5000), ("ok", "hi"))]
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    m, rows, errors = _plan(tmp_path, src, input__max_line_bytes=1000)
    assert m.format == "openai_batch" and rows == {"ok"} and errors[0]["line"] == 1


def test_an_over_long_csv_line_is_its_own_error_and_an_over_long_header_fails_the_file(tmp_path):
    src = tmp_path / "in.csv"
    src.write_text(f'id,prompt\na,hi\nlong,{"x" * 5000}\nq,"two\n{"y" * 5000}"\nb,hi\n')
    m, rows, errors = _plan(tmp_path, src, input__max_line_bytes=1000)
    assert rows == {"a", "b"}
    assert [(e["line"], e["reason"]) for e in errors] == [
        (3, "line 3 is longer than 1000 characters (input.max_line_bytes); skipped without being read"),
        (4, "line 5 is longer than 1000 characters (input.max_line_bytes); skipped without being read")]
    header = tmp_path / "h.csv"
    header.write_text(f'id,prompt,{"c" * 5000}\na,hi,\n')
    cfg = demo_config(tmp_path, input__path=str(header), input__max_line_bytes=1000)
    with pytest.raises(InputFileError, match="the header: line 1 is longer than 1000 characters"):
        list(read_file_rows(UPath(header), "csv", cfg.input))


def test_a_300_mb_line_is_an_error_in_bounded_memory(tmp_path):
    """A sparse file: a good line, 300 MB of zeros without a newline, a good line. Planned in a process of its own
    at the default limit, the peak resident memory grows far less than the line (reading it whole took ~2.4 GB)."""
    src = tmp_path / "huge.jsonl"
    with open(src, "wb") as fh:
        fh.write(b'{"id": "a", "prompt": "hi"}\n')
        fh.seek(300 * 2**20, os.SEEK_CUR)  # a hole: no disk, read back as zeros
        fh.write(b'\n{"id": "b", "prompt": "hi"}\n')
    script = textwrap.dedent(f"""
        import json, resource
        from pathlib import Path
        from helpers import demo_config
        from batch_llm.io.storage import Location, iter_jsonl
        from batch_llm.stages import plan as plan_mod
        cfg = demo_config(Path({str(tmp_path)!r}), input__path={str(src)!r})
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        m = plan_mod.write_plan(cfg, input_loc=Location({str(src)!r}), plan_dir=Location({str(tmp_path / "plan")!r}))
        grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
        rows = sorted(r["id"] for s in m.shards for r in iter_jsonl(Location(s.url).path()))
        print(json.dumps({{"grown_mb": grown, "rows": rows, "errors": list(iter_jsonl(Location(m.errors).path()))}}))
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), *sys.path])}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["grown_mb"] < 200, got["grown_mb"]  # ~2 x the 64 MiB read of the line's start, not its 300 MB
    assert got["rows"] == ["a", "b"]
    assert [(e["line"], e["reason"].split(" (")[0]) for e in got["errors"]] == [(2, "the line is longer than "
                                                                                 f"{64 * 2**20} bytes")]



def test_run_batch_output_keeps_an_over_long_lines_place_in_input_order(tmp_path):
    """``batch-llm run-batch`` writes one output line per input line: an over-long line's error line (it has no
    custom_id: it was not read) takes its place, the line itself is not read whole."""
    from batch_llm.frontends import run_batch as rb

    src = tmp_path / "in.jsonl"
    src.write_text('{"custom_id": "a"}\n' + json.dumps({"custom_id": "long", "pad": "x" * 500}) + '\n{"custom_id": "b"}\n')

    def line(cid, status):
        return {"custom_id": cid, "response": {"status_code": status}}

    done = {"a": [line("a", 200)], "b": [line("b", 200)]}
    from batch_llm.config import InputConfig

    limit = InputConfig(path=str(src), max_line_bytes=100)
    got = list(rb.in_input_order([src], done, {None: [line(None, 400)]}, limit))
    assert [(x["custom_id"], x["response"]["status_code"]) for x in got] == [("a", 200), (None, 400), ("b", 200)]
