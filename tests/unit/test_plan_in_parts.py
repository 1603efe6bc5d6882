"""The plan in parts (``sharding.plan_part_bytes``) against the one-task plan of the same day: the same records in
the same order, the same errors (a duplicate id across files found and joined to its first line), the same rows in
the shards with the same indexes; a second plan redoes nothing, a changed file redoes its own part's scan and
moves only the shards whose row indexes move."""
from __future__ import annotations

import json

import pytest
from batch_llm import api
from batch_llm.config import ConfigError
from batch_llm.io.storage import Location, iter_jsonl
from batch_llm.layout import RunLayout
from batch_llm.manifests import PlanManifest
from batch_llm.stages import plan as plan_mod
from batch_llm.stages import plan_parts
from helpers import demo_config


def _day(folder):
    """Five files: ids unique but where noted; a bad line, a row without a prompt, ids repeated in a file and
    across files (the later ones are the duplicates)."""
    folder.mkdir(parents=True)
    files = {
        "a.jsonl": [{"id": f"a{i}", "prompt": "p" * (i + 1)} for i in range(6)] + [{"id": "a1", "prompt": "again"}],
        "b.jsonl": [{"id": "b0", "prompt": "x"}, "{not json", {"id": "a3", "prompt": "from a"},
                    {"id": "b1", "prompt": "yy"}],
        "c.jsonl": [{"id": f"c{i}", "prompt": "q" * (7 - i)} for i in range(5)] + [{"id": "c9"}],
        "d.jsonl": [{"id": "b1", "prompt": "from b"}, {"id": "d0", "prompt": "z", "max_tokens": 8}],
        "e.jsonl": [{"id": f"e{i}", "prompt": "e" * i + "!"} for i in range(4)],
    }
    for name, rows in files.items():
        (folder / name).write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return folder


def _cfg(tmp_path, folder, **over):
    return demo_config(tmp_path, input__path=str(folder), output__parts=True, sharding__rows_per_shard=3, **over)


def _layout(cfg, run_id):
    return RunLayout.for_run(cfg, run_id=run_id, ds="2026-12-07")


def _shard_rows(m: PlanManifest) -> list[dict]:
    return sorted((r for s in m.shards for r in iter_jsonl(Location(s.url).path())), key=lambda r: r["idx"])


def test_parts_plan_the_same_day_as_one_task(tmp_path):
    folder = _day(tmp_path / "in")
    one = api.plan_shards(_cfg(tmp_path, folder), _layout(_cfg(tmp_path, folder), "one"))
    cfg = _cfg(tmp_path, folder, sharding__plan_part_bytes=300)
    parted = api.plan_shards(cfg, _layout(cfg, "parted"))
    assert parted.parts is not None and parted.parts >= 3 and one.parts is None
    for field in ("rows_read", "valid", "invalid", "duplicates", "format", "input_files", "has_references"):
        assert getattr(parted, field) == getattr(one, field), field
    assert (one.rows_read, one.valid, one.duplicates) == (23, 18, 3)
    assert list(parted.iter_records({})) == list(one.iter_records({}))
    errors = list(iter_jsonl(Location(parted.errors).path()))
    assert errors == list(iter_jsonl(Location(one.errors).path()))
    dups = {e["id"]: e["duplicate_of"] for e in errors if "duplicate_of" in e}
    assert dups == {"a1": "a.jsonl:2", "a3": "a.jsonl:4", "b1": "b.jsonl:4"}
    assert _shard_rows(parted) == _shard_rows(one)
    assert [s.index for s in parted.shards] == list(range(len(parted.shards)))
    for s in parted.shards:  # each shard's records are its own rows, in the shard's idx range
        recs = [r["idx"] for r in iter_jsonl(Location(s.records).path())]
        assert sorted(r["idx"] for r in iter_jsonl(Location(s.url).path())) == recs and len(recs) == s.rows


@pytest.mark.parametrize("buckets", [2, 64])
def test_the_join_finds_the_same_over_any_bucket_groups(tmp_path, monkeypatch, buckets):
    """Fewer buckets than parts (a join task with none) or many: the same duplicates, errors and shard rows as a
    join of the whole day in one group (one part)."""
    folder = _day(tmp_path / "in")
    cfg = _cfg(tmp_path, folder, sharding__plan_part_bytes=10**6)
    whole = api.plan_shards(cfg, _layout(cfg, "whole"))
    assert whole.parts == 1
    monkeypatch.setattr(plan_parts, "BUCKETS", buckets)
    monkeypatch.setattr(plan_parts, "HEADER_BYTES", (buckets + 1) * 8)
    cfg = _cfg(tmp_path, folder, sharding__plan_part_bytes=100)
    grouped = api.plan_shards(cfg, _layout(cfg, "grouped"))
    assert (grouped.parts or 0) >= 5
    joins = [plan_parts.GroupJoin.read(_layout(cfg, "grouped").stage("plan").child("join", f"group-{g:05d}").path())
             for g in range(grouped.parts or 0)]
    assert sum(j.entries for j in joins) == whole.valid + whole.duplicates
    assert (buckets < len(joins)) == any(j.entries == 0 for j in joins)
    assert list(iter_jsonl(Location(grouped.errors).path())) == list(iter_jsonl(Location(whole.errors).path()))
    assert _shard_rows(grouped) == _shard_rows(whole)


def test_again_nothing_is_redone_and_a_changed_file_redoes_its_part(tmp_path, monkeypatch):
    folder = _day(tmp_path / "in")
    cfg = _cfg(tmp_path, folder, sharding__plan_part_bytes=300)
    layout = _layout(cfg, "run")
    first = api.plan_shards(cfg, layout)
    scanned: list = []
    run = plan_mod.InputScan.run
    monkeypatch.setattr(plan_mod.InputScan, "run", lambda self, files, *a, **k: (scanned.append(
        [f.name for f in files]), run(self, files, *a, **k))[1])
    written: list = []
    write = plan_parts.write_part
    monkeypatch.setattr(plan_parts, "write_part", lambda c, lay, i: (written.append(i), write(c, lay, i))[1])
    again = api.plan_shards(cfg, layout)
    assert scanned == [] and again.shards == first.shards
    assert {w for w in written} == set(range(first.parts or 0))  # each asked, each returned its committed write

    # a row added at the day's end: the last part scanned again, the others' shards (and plan keys) unchanged
    with open(folder / "e.jsonl", "a") as fh:
        fh.write(json.dumps({"id": "e9", "prompt": "late"}) + "\n")
    later = api.plan_shards(cfg, layout)
    assert len(scanned) == 1 and scanned[0][-1] == "e.jsonl"  # the last part only (d and e)
    assert later.valid == first.valid + 1
    keep = [s for s in first.shards if s.index < later.shards[-1].index - 1]
    assert keep and all(s in later.shards for s in keep)

    # a row added to the first file: its part scanned again; the parts after it keep their scans but their
    # shards move (their row indexes do)
    scanned.clear()
    with open(folder / "a.jsonl", "a") as fh:
        fh.write(json.dumps({"id": "a9", "prompt": "late too"}) + "\n")
    moved = api.plan_shards(cfg, layout)
    assert len(scanned) == 1 and scanned[0][0] == "a.jsonl"  # the first part only
    assert moved.shards[-1].plan_key != later.shards[-1].plan_key
    one = api.plan_shards(_cfg(tmp_path, folder), _layout(_cfg(tmp_path, folder), "one"))
    assert list(moved.iter_records({})) == list(one.iter_records({}))


def test_settings_a_plan_in_parts_cannot_take_are_refused(tmp_path):
    with pytest.raises((ConfigError, ValueError), match="output.parts"):
        demo_config(tmp_path, sharding__plan_part_bytes=1000)
    with pytest.raises((ConfigError, ValueError), match="rows_per_shard"):
        demo_config(tmp_path, sharding__plan_part_bytes=1000, output__parts=True, sharding__num_shards=2)


def test_steps_cleared_apart_scan_a_changed_file_and_refuse_a_stale_plan(tmp_path):
    """As a Clear of one ``plan_scan`` (its listing kept): the changed file's part is scanned again; a join whose
    part was not scanned again, or whose folder gained a file since the listing, fails saying what to clear."""
    folder = _day(tmp_path / "in")
    cfg = _cfg(tmp_path, folder, sharding__plan_part_bytes=300)
    layout = _layout(cfg, "run")
    first = api.plan_shards(cfg, layout)
    last = (first.parts or 0) - 1
    with open(folder / "e.jsonl", "a") as fh:
        fh.write(json.dumps({"id": "e9", "prompt": "late"}) + "\n")
    with pytest.raises(RuntimeError, match=f"plan part {last}: .*clear that plan_scan task"):
        api.plan_place(cfg, layout)
    before = plan_parts.PartScan.read(plan_parts._part_dir(layout, last).path()).rows_read
    assert api.plan_scan_part(cfg, layout, last).rows_read == before + 1
    with pytest.raises(RuntimeError, match=r"plan_join group\(s\) \[0, .*clear plan_join"):
        api.plan_place(cfg, layout)  # the join ran before that scan
    for g in range(first.parts or 0):
        api.plan_join_group(cfg, layout, g)
    for place in api.plan_place(cfg, layout).places:
        api.plan_write_part(cfg, layout, place.part)
    assert api.plan_gather(cfg, layout).valid == first.valid + 1
    (folder / "f.jsonl").write_text(json.dumps({"id": "f0", "prompt": "new file"}) + "\n")
    with pytest.raises(RuntimeError, match="clear plan_parts"):
        api.plan_place(cfg, layout)


def test_a_big_parquet_file_is_planned_in_parts_of_its_row_groups(tmp_path):
    """One Parquet file of 6 row groups beside a small one is split into parts of its row groups (from its
    footer); the rows' line numbers, an id repeated across row groups and a row without a prompt come out as the
    one-task plan has them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "in"
    folder.mkdir()
    rows = [{"id": f"p{i}", "prompt": None if i == 7 else "w" * (i % 5 + 1)} for i in range(60)]
    rows[45]["id"] = "p3"  # in the 5th row group, the id of a row of the 1st
    pq.write_table(pa.Table.from_pylist(rows), folder / "a.parquet", row_group_size=10)
    pq.write_table(pa.Table.from_pylist([{"id": "p12", "prompt": "again"}]), folder / "b.parquet")
    one = api.plan_shards(_cfg(tmp_path, folder), _layout(_cfg(tmp_path, folder), "one"))
    cfg = _cfg(tmp_path, folder, sharding__plan_part_bytes=(folder / "a.parquet").stat().st_size // 3)
    parted = api.plan_shards(cfg, _layout(cfg, "parted"))
    listed = plan_parts.PartsManifest.read(plan_parts._parts_dir(_layout(cfg, "parted")).path())
    # 210 compressed bytes a row group: four to a part; p3's repeat (row 46) is in the second part, its first in the first
    assert [p.row_groups for p in listed.parts] == [(0, 4), (4, 6), None]
    assert (parted.rows_read, parted.valid, parted.duplicates, parted.invalid) == (61, 58, 2, 3)
    assert list(parted.iter_records({})) == list(one.iter_records({}))
    errors = list(iter_jsonl(Location(parted.errors).path()))
    assert errors == list(iter_jsonl(Location(one.errors).path()))
    assert {e["id"]: (e["line"], e.get("duplicate_of")) for e in errors} == {
        "p7": (8, None), "p3": (46, "a.parquet:4"), "p12": (1, "a.parquet:13")}
    assert _shard_rows(parted) == _shard_rows(one)
