"""Bad rows in CSV and Parquet input: each becomes an error row naming its file, line (row) and reason, and the
rest of the file is planned, as JSONL input does it; a file no row of which can be read (corrupt Parquet, a table
without a prompt column) is one clear error naming the file."""
from __future__ import annotations

import csv
import datetime
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from batch_llm.config.input import MAX_LINE_BYTES
from batch_llm.io import formats
from batch_llm.io.storage import Location, iter_jsonl
from batch_llm.stages import plan as plan_mod
from helpers import demo_config
from upath import UPath


def _plan(tmp_path, path, **over):
    cfg = demo_config(tmp_path, input__path=str(path), **over)
    return plan_mod.write_plan(cfg, input_loc=Location(str(path)), plan_dir=Location(str(tmp_path / "plan")))


def _planned(tmp_path, path, **over) -> tuple[set[str], dict[int, dict]]:
    """The ids planned and the errors by line; every row read is one or the other."""
    m = _plan(tmp_path, path, **over)
    ids = {r["id"] for s in m.shards for r in iter_jsonl(Location(s.url).path())}
    errors = {e["line"]: e for e in iter_jsonl(Location(m.errors).path())}
    assert m.rows_read == m.valid + m.invalid == len(ids) + len(errors)
    assert all(e["source"] == path.name and e["reason"] for e in errors.values())
    return ids, errors


# ----------------------------------------------------------------------------------------------------- CSV
def test_csv_row_with_a_non_utf8_byte_is_a_row_error(tmp_path):
    p = tmp_path / "in.csv"
    p.write_bytes(b'id,prompt\na,hello\nb,caf\xe9 au lait\nc,"two\nlines \xff"\nd,bye\n')
    ids, errors = _planned(tmp_path, p)
    assert ids == {"a", "d"}
    assert errors[3]["reason"] == "not valid UTF-8 at byte 5"   # lines of the file: the header is line 1
    assert errors[4]["reason"] == "not valid UTF-8 at byte 6 of line 5"  # a quoted cell over two lines


def test_csv_lines_count_quoted_line_breaks_blank_lines_and_crlf(tmp_path):
    p = tmp_path / "in.csv"
    p.write_bytes(b'id,prompt\r\na,"one\r\ntwo\nthree"\r\n\r\nb,x,extra\n\nc,"\n"\nd\ne,ok\n')
    rows = list(formats.read_file_rows(UPath(str(p)), "csv", formats.Lines(MAX_LINE_BYTES)))
    assert [(r.line, (r.record or {}).get("id"), r.error) for r in rows] == [
        (2, "a", None), (6, None, "1 more field(s) than the header has"), (8, "c", None),
        (10, None, "1 field(s) fewer than the header has"), (11, "e", None)]


def test_pyarrow_csv_handler_counts_records_not_lines():
    """Why CSV input stays on the csv module (``io.formats._read_csv``): pyarrow's ``invalid_row_handler`` numbers
    a bad row by records (here 3; the row is on line 5, after a quoted line break and a blank line) and valid rows
    not at all; a record past ``block_size`` fails the rest of the file. When this fails, pyarrow gives lines."""
    import io

    import pyarrow.csv as pc

    seen = []

    def skip(row) -> str:
        seen.append(row)
        return "skip"

    reader = pc.open_csv(io.BytesIO(b'id,prompt\na,"two\nlines"\n\nb,x,extra\nc,ok\n'),
                         read_options=pc.ReadOptions(use_threads=False),
                         parse_options=pc.ParseOptions(newlines_in_values=True,
                                                       invalid_row_handler=skip))
    assert [r["id"] for b in reader for r in b.to_pylist()] == ["a", "c"]
    assert [r.number for r in seen] == [3]
    with pytest.raises(pa.ArrowInvalid, match="straddl"):
        list(pc.open_csv(io.BytesIO(b"id,prompt\na," + b"y" * 3000 + b"\nb,z\n"),
                         read_options=pc.ReadOptions(block_size=1024)))


def test_csv_with_a_byte_order_mark_keeps_its_first_column(tmp_path):
    p = tmp_path / "in.csv"
    p.write_bytes(b"\xef\xbb\xbfid,prompt\na,hello\n")  # as Excel writes "CSV UTF-8"
    assert _planned(tmp_path, p) == ({"a"}, {})


def test_csv_cell_of_200_kb_is_read(tmp_path):
    p = tmp_path / "in.csv"
    p.write_text(f"id,prompt\na,{'x' * 200_000}\nb,short\n")
    ids, errors = _planned(tmp_path, p)
    assert ids == {"a", "b"} and errors == {}


def test_csv_cell_over_the_limit_is_a_row_error_and_the_file_goes_on(tmp_path, monkeypatch):
    monkeypatch.setattr(formats, "CSV_FIELD_LIMIT", 1000, raising=False)  # the old reader had no such constant
    p = tmp_path / "in.csv"
    p.write_text(f"id,prompt\na,hi\nb,{'x' * 5000}\nc,bye\n")
    limit = csv.field_size_limit()
    try:
        ids, errors = _planned(tmp_path, p)
    finally:
        csv.field_size_limit(limit)
    assert ids == {"a", "c"}
    assert "field larger than field limit (1000)" in errors[3]["reason"]


def test_csv_rows_with_wrong_field_counts_or_empty_prompts_are_row_errors(tmp_path):
    p = tmp_path / "in.csv"
    p.write_text("id,prompt,reference\na,hi,ref\nb,hi,ref,extra\nc,hi\nd,,ref\ne,\"  \",\nf,bye,\n")
    ids, errors = _planned(tmp_path, p)
    assert ids == {"a", "f"}
    assert {line: e["reason"] for line, e in errors.items()} == {
        3: "1 more field(s) than the header has",
        4: "1 field(s) fewer than the header has",
        5: "empty prompt",
        6: "empty prompt",
    }
    assert errors[3]["id"] is None and errors[5]["id"] == "d"


def test_csv_without_a_prompt_column_is_one_error_naming_the_file_and_its_columns(tmp_path):
    p = tmp_path / "in.csv"
    p.write_text("id,text\na,hi\n")
    with pytest.raises(ValueError, match=r"in\.csv.*'messages' or 'prompt'.*its columns: id, text"):
        _plan(tmp_path, p)
    with pytest.raises(ValueError, match=r"in\.csv.*template's column\(s\) 'lang'.*id, text"):
        _plan(tmp_path, p, input__template="To {lang}: {text}")
    assert _planned(tmp_path, p, input__template="Say: {text}") == ({"a"}, {})  # the template's columns suffice


def test_csv_header_that_is_not_utf8_is_an_error_naming_the_file(tmp_path):
    p = tmp_path / "in.csv"
    p.write_bytes(b"id,pr\xf6mpt\na,hi\n")
    with pytest.raises(ValueError, match=r"in\.csv: the header is not valid UTF-8 at byte 5"):
        _plan(tmp_path, p)


# ------------------------------------------------------------------------------------------------- Parquet
def test_parquet_null_prompt_or_id_is_a_row_error(tmp_path):
    p = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": ["a", "b", None, "d"], "prompt": ["hi", None, "x", "bye"]}), p)
    ids, errors = _planned(tmp_path, p)
    assert ids == {"a", "d"}
    assert errors[2]["reason"] == "no prompt: 'prompt' is null" and errors[2]["id"] == "b"
    assert errors[3]["reason"] == "missing id (column 'id')"


def test_parquet_values_of_the_wrong_type_are_row_errors(tmp_path):
    """An int or a list where text is expected, and a value Python cannot hold (a date past year 9999):
    that row fails, not the batch it was read in."""
    p = tmp_path / "ints.parquet"
    pq.write_table(pa.table({"id": ["a", "b"], "prompt": [1, 2]}), p)
    ids, errors = _planned(tmp_path, p)
    assert ids == set() and errors[1]["reason"] == "prompt must be a string, got int"
    p = tmp_path / "lists.parquet"
    pq.write_table(pa.table({"id": ["a", "b"], "prompt": [["hi"], None]}), p)
    ids, errors = _planned(tmp_path / "l", p)
    assert ids == set() and errors[1]["reason"] == "prompt must be a string, got list"
    p = tmp_path / "dates.parquet"
    when = pa.array([0, 3_000_000, 20_000], type=pa.date32())  # day 3,000,000: year 10183
    pq.write_table(pa.table({"id": ["a", "b", "c"], "prompt": ["hi", "hi", "hi"], "when": when}), p)
    ids, errors = _planned(tmp_path / "d", p)
    assert ids == {"a", "c"} and errors[2]["reason"] == "column 'when': date value out of range"
    rec = next(iter_jsonl(Location(str(tmp_path / "d" / "plan" / "records.jsonl")).path()))
    assert rec["record"]["when"] == str(datetime.date(1970, 1, 1))


def test_parquet_without_a_prompt_column_is_one_error_naming_the_file_and_its_columns(tmp_path):
    p = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": ["a"], "question": ["hi"]}), p)
    with pytest.raises(ValueError, match=r"in\.parquet.*'messages' or 'prompt'.*its columns: id, question"):
        _plan(tmp_path, p)
    pq.write_table(pa.table({"key": ["a"], "prompt": ["hi"]}), p)
    with pytest.raises(ValueError, match=r"in\.parquet.*the id column 'id'.*its columns: key, prompt"):
        _plan(tmp_path, p)
    assert _planned(tmp_path, p, input__id_column="key") == ({"a"}, {})


@pytest.mark.parametrize("damage", ["truncated", "empty", "middle"])
def test_corrupt_parquet_is_an_error_naming_the_file(tmp_path, damage):
    good = tmp_path / "good.parquet"
    pq.write_table(pa.Table.from_pylist([{"id": f"r{i}", "prompt": f"hello {i} " * 20} for i in range(20_000)]),
                   good, row_group_size=5000)
    data = bytearray(good.read_bytes())
    if damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "empty":
        data = bytearray()
    else:  # the footer intact, a row group's compressed pages overwritten
        third = len(data) // 3
        data[third:third + 2000] = b"Z" * 2000
    p = tmp_path / "in.parquet"
    p.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"in\.parquet: .*Parquet") as e:
        _plan(tmp_path, p)
    assert not isinstance(e.value, (pa.ArrowException, OSError))

# --------------------------------------------------------------------------------------- JSONL, OpenAI Batch
def test_jsonl_text_no_utf8_can_hold_is_a_row_error_and_the_file_goes_on(tmp_path):
    """A lone surrogate escape is valid JSON but no character: json reads it into a string UTF-8 cannot hold.
    The row fails with the reason (not the plan, with a traceback), as does nesting deeper than Python reads."""
    p = tmp_path / "in.jsonl"
    deep = "[" * 5000 + "]" * 5000
    p.write_text('{"id": "a", "prompt": "hi"}\n'
                 '{"id": "b", "prompt": "hi \\ud800 there"}\n'
                 '{"id": "c\\udfff", "prompt": "hi"}\n'
                 f'{{"id": "d", "prompt": "hi", "meta": {deep}}}\n'
                 '{"id": "e", "prompt": "a pair is one character: \\ud83d\\ude00"}\n', encoding="utf-8")
    ids, errors = _planned(tmp_path, p)
    assert ids == {"a", "e"}
    assert errors[2]["reason"] == ("holds the escape \\ud800, a lone UTF-16 surrogate: no character, so no UTF-8 "
                                   "text can hold it")
    assert "\\udfff" in errors[3]["reason"]
    assert errors[4]["reason"].startswith("JSON nested deeper than")


def test_openai_batch_line_with_a_lone_surrogate_is_a_row_error(tmp_path):
    p = tmp_path / "batch.jsonl"
    line = '{{"custom_id": "{}", "method": "POST", "url": "/v1/chat/completions", ' \
           '"body": {{"messages": [{{"role": "user", "content": "{}"}}]}}}}\n'
    p.write_text(line.format("r1", "hi") + line.format("r2", "bad \\udc80") + line.format("r3", "bye"))
    m = _plan(tmp_path, p)
    assert m.format == "openai_batch" and (m.valid, m.invalid) == (2, 1)
    assert [e["line"] for e in iter_jsonl(Location(m.errors).path())] == [2]


def test_csv_stop_cell_nested_too_deeply_is_a_row_error(tmp_path):
    p = tmp_path / "in.csv"
    p.write_text(f'id,prompt,stop\na,hi,\nb,hi,{"[" * 5000}\n')
    ids, errors = _planned(tmp_path, p, input__sampling_columns=["max_tokens", "stop"])
    assert ids == {"a"} and errors[3]["reason"].startswith("JSON nested deeper than")


@pytest.mark.parametrize("fmt", ["jsonl", "openai_batch"])
def test_a_byte_order_mark_is_not_part_of_the_first_row(tmp_path, fmt):
    """Notepad and Excel begin a UTF-8 file with a byte order mark; the first row is read, and an OpenAI Batch
    file is still told from its first line."""
    p = tmp_path / "in.jsonl"
    if fmt == "jsonl":
        lines = [{"id": "a", "prompt": "hi"}, {"id": "b", "prompt": "bye"}]
    else:
        lines = [{"custom_id": c, "method": "POST", "url": "/v1/chat/completions",
                  "body": {"messages": [{"role": "user", "content": "hi"}]}} for c in ("a", "b")]
    p.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(line) + "\n" for line in lines).encode())
    m = _plan(tmp_path, p)
    assert m.format == fmt and (m.valid, m.invalid) == (2, 0)


def test_parquet_text_that_is_not_utf8_is_a_row_error(tmp_path):
    p = tmp_path / "in.parquet"
    text = pa.array([b"hello", b"caf\xe9", b"bye"], type=pa.binary()).view(pa.string())  # unchecked bytes
    pq.write_table(pa.table({"id": ["a", "b", "c"], "prompt": text}), p)
    ids, errors = _planned(tmp_path, p)
    assert ids == {"a", "c"} and errors[2]["reason"].startswith("column 'prompt': 'utf-8' codec can't decode")


# ------------------------------------------------------------------------------------------------ writing
@pytest.mark.parametrize("fmt", ["jsonl", "openai_batch", "csv", "parquet"])
def test_writing_a_lone_surrogate_writes_its_escape_in_every_format(tmp_path, fmt):
    """Text UTF-8 cannot hold (a lone surrogate, from a library caller or a filter's mask) never fails the write
    of outputs or errors: the character is written as its escape text."""
    from batch_llm.io.storage import write_jsonl

    path = Location(str(tmp_path / f"out{formats.FILE_SUFFIX[fmt]}")).path()
    assert formats.write_rows(path, [{"id": "a", "output": "x \ud800 y"}, {"id": "b", "output": "ok"}], fmt) == 2
    back = [r.record for r in formats.read_file_rows(path, "jsonl" if fmt == "openai_batch" else fmt,
                                                        formats.Lines(MAX_LINE_BYTES))]
    assert back == [{"id": "a", "output": "x \\ud800 y"}, {"id": "b", "output": "ok"}]
    errors = Location(str(tmp_path / "errors.jsonl")).path()
    assert write_jsonl(errors, [{"id": "\udc80", "reason": "r"}, {"id": "b", "reason": "r"}]) == 2
    assert [e["id"] for e in iter_jsonl(errors)] == ["\\udc80", "b"]
