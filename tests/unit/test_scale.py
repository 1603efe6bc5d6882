"""Scale is part of correctness: stages stream, so memory does not follow the run's size.

The RSS test runs the stages over 300k rows, each in a fresh process (``bench/scale.py stage NAME``), and
bounds their peak memory: holding the run (as the planner and publish once did: ~2 GB at 1M rows) would
exceed it several times over. No wall-clock assertions.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from batch_llm.config import parse_config
from batch_llm.io.formats import write_rows
from batch_llm.io.storage import Location, iter_jsonl
from batch_llm.stages import plan as plan_mod

ROOT = Path(__file__).resolve().parents[2]
SCALE = ROOT / "bench" / "scale.py"
RSS_BOUND_MB = 260   # a bare process with the stage's imports is ~90-100 MB; 300k rows held in lists ~700 MB


def _cfg(tmp: Path, input_path: Path, **extra) -> dict:
    return {"name": "scale", "model": {"ref": "unused"}, "input": {"path": str(input_path), "format": "auto"},
            "output": {"path": str(tmp / "out")}, "cache": {"enabled": False}, **extra}


def _stage(name: str, work: Path) -> dict:
    p = subprocess.run([sys.executable, str(SCALE), "stage", name, str(work)], capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin", "TMPDIR": str(work), "HOME": str(work)})
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(600)
def test_plan_filter_publish_300k_rows_in_bounded_memory(tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    from scale import make_input

    make_input(tmp_path / "input.jsonl", 300_000)
    # One shard of all rows: its length sort must spill (runs of plan.SORT_RUN_ROWS) to stay bounded.
    # (prefix groups off: the length order is checked below; groups across spilled runs: test_formats_plan)
    cfg = _cfg(tmp_path, tmp_path / "input.jsonl", sharding={"num_shards": 1, "group_prefixes": False},
               evaluate={"enabled": False})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    peaks = {name: _stage(name, tmp_path) for name in ("plan", "synthesize", "filter", "evaluate", "publish")}
    assert peaks["plan"]["valid"] == 300_000 and peaks["publish"]["rows"] == 300_000
    for name in ("plan", "filter", "publish"):
        assert peaks[name]["peak_rss_mb"] < RSS_BOUND_MB, (name, peaks[name])
    # The one shard is sorted by prompt length (then input order) across the spilled runs.
    shard = tmp_path / "out" / "scale" / "runs" / "dt=2026-12-01" / "scale" / "plan" / "shard-00000.jsonl"
    prev = (-1, -1)
    n = 0
    for r in iter_jsonl(Location(str(shard)).path()):
        key = (sum(len(m["content"]) for m in r["messages"]), r["idx"])
        assert key > prev
        prev, n = key, n + 1
    assert n == 300_000


def test_external_sort_equals_in_memory_sort(tmp_path, monkeypatch):
    rows = [{"id": f"r{i}", "prompt": "x" * ((i * 7919) % 50 + 1)} for i in range(1000)]
    write_rows(Location(str(tmp_path / "in.jsonl")).path(), rows, "jsonl")
    cfg = parse_config(_cfg(tmp_path, tmp_path / "in.jsonl", sharding={"rows_per_shard": 400}))

    def shard_ids(out: str, run_rows: int) -> list[list[str]]:
        monkeypatch.setattr(plan_mod, "SORT_RUN_ROWS", run_rows)
        m = plan_mod.write_plan(cfg, input_loc=Location(str(tmp_path / "in.jsonl")),
                                 plan_dir=Location(str(tmp_path / out)))
        return [[r["id"] for r in iter_jsonl(Location(s.url).path())] for s in m.shards]

    in_memory, spilled = shard_ids("a", 100_000), shard_ids("b", 7)
    assert spilled == in_memory and [len(s) for s in in_memory] == [334, 333, 333]
    expect = sorted(rows[:334], key=lambda r: len(r["prompt"]))  # stable: ties keep input order
    assert in_memory[0] == [r["id"] for r in expect]


def test_duplicates_found_exactly_even_when_every_hash_collides(tmp_path, monkeypatch):
    """Equal id hashes only nominate candidates; ids decide. With every hash equal, the result is the same."""
    ids = ["a", "b", "a", "c", "b", "a", "d"]
    write_rows(Location(str(tmp_path / "in.jsonl")).path(), [{"id": i, "prompt": f"p{n}"} for n, i in enumerate(ids)],
               "jsonl")
    cfg = parse_config(_cfg(tmp_path, tmp_path / "in.jsonl"))
    results = []
    for name, hasher in (("real", hash), ("colliding", lambda _: 0)):
        monkeypatch.setattr(plan_mod, "id_hash", hasher)
        m = plan_mod.write_plan(cfg, input_loc=Location(str(tmp_path / "in.jsonl")),
                                 plan_dir=Location(str(tmp_path / name)))
        errors = list(iter_jsonl(Location(m.errors).path()))
        kept = sorted(r["id"] for s in m.shards for r in iter_jsonl(Location(s.url).path()))
        results.append((m.valid, m.duplicates, kept, [(e["line"], e["reason"]) for e in errors]))
    assert results[0] == results[1]
    valid, dups, kept, errors = results[0]
    assert (valid, dups, kept) == (4, 3, ["a", "b", "c", "d"])
    assert errors == [(3, "duplicate id 'a' (first at in.jsonl:1)"), (5, "duplicate id 'b' (first at in.jsonl:2)"),
                      (6, "duplicate id 'a' (first at in.jsonl:1)")]


def test_a_folder_of_parts_is_read_in_order_with_errors_naming_file_and_line(tmp_path):
    lake = tmp_path / "dt=2026-12-01"
    lake.mkdir()
    (lake / "_SUCCESS").write_text("")
    for part in range(3):
        lines = [json.dumps({"id": f"p{part}-{i}", "prompt": f"q {i}"}) for i in range(4)]
        if part == 1:
            lines[2] = '{"id": "broken", "prompt": '
        (lake / f"part-{part:05d}.jsonl").write_text("\n".join(lines) + "\n")
    (lake / "part-00001.jsonl").write_text((lake / "part-00001.jsonl").read_text()
                                           + json.dumps({"id": "p0-1", "prompt": "again"}) + "\n")
    cfg = parse_config(_cfg(tmp_path, lake))
    m = plan_mod.write_plan(cfg, input_loc=Location(str(lake)), plan_dir=Location(str(tmp_path / "plan")))
    assert (m.input_files, m.rows_read, m.valid, m.invalid) == (3, 13, 11, 2)
    records = [r["id"] for r in iter_jsonl(Location(m.records).path())]
    assert records == [f"p{p}-{i}" for p in range(3) for i in range(4) if (p, i) != (1, 2)]
    assert [r["idx"] for r in iter_jsonl(Location(m.records).path())] == list(range(11))
    errors = [(e["source"], e["line"], e["reason"][:22]) for e in iter_jsonl(Location(m.errors).path())]
    assert errors == [("part-00001.jsonl", 3, "not valid JSON: Expect"),
                      ("part-00001.jsonl", 5, "duplicate id 'p0-1' (f")]
    dup = list(iter_jsonl(Location(m.errors).path()))[1]
    assert "first at part-00000.jsonl:2" in dup["reason"] and dup["duplicate_of"] == "part-00000.jsonl:2"


def test_scoring_sample_is_seeded_bounded_and_grows_as_a_superset():
    from batch_llm.stages.evaluate import sample_for_scoring

    records = [{"idx": i, "id": f"r{i}", "reference": f"ref {i}" if i % 3 else None} for i in range(3000)]
    outputs = [{"idx": i, "id": f"r{i}", "output": f"out {i}"} for i in range(3000) if i % 7]
    shards = [[{"id": f"r{i}", "messages": [{"role": "user", "content": f"q {i}"}]} for i in range(3000)][::-1]]

    def pick(size, seed, recs=records):
        s = sample_for_scoring(records=recs, outputs=outputs, shards=shards, size=size, seed=seed)
        return s, [r["id"] for r in s.records]

    s, ids = pick(100, 0)
    eligible = sum(1 for i in range(3000) if i % 3 and i % 7)
    assert s.population == eligible and len(ids) == 100 == len(set(ids))
    assert pick(100, 0)[1] == ids and pick(100, 1)[1] != ids            # seeded
    assert set(ids) <= set(pick(200, 0)[1])                             # a larger sample is a superset
    assert [int(i[1:]) for i in ids] == sorted(int(i[1:]) for i in ids)  # in input order
    r = s.records[0]
    n = int(r["id"][1:])
    assert r == {"id": f"r{n}", "output": f"out {n}", "reference": f"ref {n}", "question": f"q {n}"}
    assert len(pick(None, 0)[1]) == eligible
