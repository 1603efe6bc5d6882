"""The result cache keys on everything that decides an output; concurrent writers never collide; a lookup
reads what the run asks for, not the history; compaction keeps the object count bounded and loses nothing."""
from __future__ import annotations

import hashlib
import random
import sys
import threading

import pytest
from batch_llm import api
from batch_llm.cache import results as result_cache
from batch_llm.cache import table as cache_table
from batch_llm.cache.results import ResultCache, namespace, prompt_key
from batch_llm.io.storage import Location, write_jsonl
from batch_llm.layout import RunLayout
from helpers import demo_config, use_echo_engine

DAY = 86400.0
T0 = 1_800_000_000.0


def test_namespace_changes_with_model_template_sampling_engine():
    """The namespace hashes the output identity (tests/unit/test_output_identity.py: what it holds)."""
    base = dict(model="m@main#abc", chat_template="T", sampling={"temperature": 0.0, "max_tokens": 8},
                engine={"kind": "vllm", "dtype": "bfloat16"})
    ns = namespace(base)
    assert namespace(dict(base)) == ns
    assert namespace({**base, "model": "m@main#abd"}) != ns
    assert namespace({**base, "chat_template": "T2"}) != ns
    assert namespace({**base, "sampling": {"temperature": 0.1, "max_tokens": 8}}) != ns
    assert namespace({**base, "engine": {"kind": "vllm", "dtype": "float32"}}) != ns
    assert prompt_key([1, 2, 3]) != prompt_key([1, 2, 4])


def test_concurrent_writers_and_union_reads(tmp_path):
    cache = ResultCache(Location(str(tmp_path)), "ns")

    def writer(i):
        cache.write_table({"key": f"k{i}-{j}", "output": f"{i}-{j}", "finish_reason": "stop", "prompt_tokens": 1,
                           "completion_tokens": 1} for j in range(50))

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert len(cache.tables()) == 8
    found = {e["key"]: e for e in cache.lookup([f"k{i}-{j}" for i in range(8) for j in range(50)] + ["missing"])}
    assert len(found) == 400 and found["k3-7"]["output"] == "3-7"


@pytest.mark.parametrize("dedupe", [True, False])
def test_a_retry_caches_what_the_crashed_attempt_generated(tmp_path, demo_model_dir, monkeypatch, request, dedupe):
    """The first attempt dies after its first chunk commit (before any table is written); the retry generates
    the rest and writes one table with every generated row, so the next run is served from the cache."""
    from batch_llm.stages.infer.commit import CHECKPOINT_EVENT

    cfg = demo_config(tmp_path, engine__kind="transformers", sharding__num_shards=1, sampling__max_tokens=8,
                      engine__commit_every_rows=4, engine__dedupe_prompts=dedupe,
                      engine__commit_every_seconds=3600)  # commits by rows only: a slow machine committed after 1
    crashed: list[str] = []
    armed = [True]

    def crash_once(event, args):  # an audit hook stays for the process: disarmed when the test ends
        if event == CHECKPOINT_EVENT and args[0] == "after_commit" and armed and not crashed:
            crashed.append(args[0])
            raise RuntimeError("injected crash")

    sys.addaudithook(crash_once)
    request.addfinalizer(lambda: armed.clear())
    echo = use_echo_engine(monkeypatch)
    layout = RunLayout.for_run(cfg, run_id="a", ds="2026-11-07")
    model = api.fetch(cfg, layout)
    plan = api.plan_shards(cfg, layout)
    with pytest.raises(RuntimeError, match="injected"):
        api.infer_shard(cfg, layout, model, plan.shards[0], say=lambda _: None)
    cache_dir = layout.cache_root(cfg).path()
    assert not list(cache_dir.rglob("*.sst")), "no table before the shard ends"
    first = echo.requests
    m = api.infer_shard(cfg, layout, model, plan.shards[0], say=lambda _: None)
    assert m.metrics.cached_rows == 0 and m.metrics.rows == 20
    assert 4 <= first < echo.requests
    assert len(list(cache_dir.rglob("*.sst"))) == 1
    layout_b = RunLayout.for_run(cfg, run_id="b", ds="2026-11-07")
    plan_b = api.plan_shards(cfg, layout_b)
    before = echo.requests
    m = api.infer_shard(cfg, layout_b, api.fetch(cfg, layout_b), plan_b.shards[0], say=lambda _: None)
    assert m.metrics.cached_rows == 20 and echo.requests == before
    assert len(list(cache_dir.rglob("*.sst"))) == 1, "a fully cached shard writes no table"


# ------------------------------------------------------------------------------------------ the format
def _key(i: int) -> str:
    return hashlib.sha256(f"prompt-{i}".encode()).hexdigest()


_POOL = "".join(random.Random(7).choices("abcdefghij klmnopqrstuvwxyz.,", k=1 << 20))


def _output(i: int) -> str:
    """Synthesized: ~400 characters of random text, a function of i (checked on every hit)."""
    o = (i * 7919) % (len(_POOL) - 500)
    return f"{i}:{_POOL[o:o + 400]}"


def _entry(i: int, t: float | None = None) -> dict:
    e = {"key": _key(i), "output": _output(i), "finish_reason": "stop", "prompt_tokens": 12,
         "completion_tokens": 100}
    if t is not None:
        e["t"] = t
    return e


def _check(found: list[dict], expect: set[int]) -> None:
    keys = [e["key"] for e in found]
    assert len(keys) == len(set(keys)), "a key came twice"
    by_key = {_key(i): i for i in expect}
    assert set(keys) == set(by_key), (len(set(keys) - set(by_key)), len(set(by_key) - set(keys)))
    assert all(e["output"] == _output(by_key[e["key"]]) for e in found)


@pytest.fixture(scope="module")
def big_cache(tmp_path_factory):
    """300k synthesized entries in 6 shard tables of 50k."""
    root = Location(str(tmp_path_factory.mktemp("big")))
    cache = ResultCache(root, "ns")
    for t in range(6):
        cache.write_table(_entry(i) for i in range(t * 50_000, (t + 1) * 50_000))
    return root


def test_a_small_run_reads_a_small_share_of_a_large_cache(big_cache):
    cache = ResultCache(big_cache, "ns", max_age_days=90)
    total = sum(t.size for t in cache.tables())
    rng = random.Random(1)
    present = set(rng.sample(range(300_000), 2000))
    absent = set(range(1_000_000, 1_002_000))
    lk = cache.lookup([_key(i) for i in present | absent])
    _check(list(lk), present)
    s = lk.stats
    assert s["hits"] == 2000 and s["keys"] == 4000 and s["tables"] == 6 and s["cache_bytes"] == total
    assert s["objects_read"] <= 6
    assert s["bytes_read"] < 0.10 * total, s
    assert s["ranges_read"] <= 6 * 3 + 2000 + 2 * 6 * 64, s  # per table: tail, key pages, offsets; values
    # A new day (all misses) reads key pages only: no offsets, no values.
    miss = cache.lookup(_key(i) for i in range(2_000_000, 2_002_000))
    assert list(miss) == [] and miss.stats["bytes_read"] < 0.05 * total, miss.stats


def test_every_key_of_a_table_and_none_other(tmp_path):
    cache = ResultCache(Location(str(tmp_path)), "ns")
    cache.write_table(_entry(i) for i in range(0, 3000, 3))
    lk = cache.lookup(_key(i) for i in range(3000))
    _check(list(lk), set(range(0, 3000, 3)))


def test_key64_collisions_are_told_apart_by_the_full_key(tmp_path):
    """Keys sharing their first 16 hex digits (the index key), 200 of them: runs over page boundaries."""
    cache = ResultCache(Location(str(tmp_path)), "ns")
    same = [f"{'ab' * 8}{i:048x}" for i in range(200)]
    others = [_key(i) for i in range(500)]
    cache.write_table([{"key": k, "output": k} for k in same[::2] + others])
    found = list(cache.lookup(same + ["ab" * 32]))
    assert sorted(e["key"] for e in found) == sorted(same[::2])
    assert all(e["output"] == e["key"] for e in found)


def _strip_root(cache: ResultCache, name: str) -> None:
    """The table as it was written before tables had a root: the same bytes less the root."""
    path = cache.dir.child(name).path()
    data = path.read_bytes()
    table = next(t for t in cache.tables() if t.name == name)
    span = cache_table.root_span(table, cache_table.parse_footer(table, data))
    assert span is not None
    path.write_bytes(data[:span[0]] + data[span[1]:])


def test_a_large_table_is_looked_up_through_its_root_not_its_whole_top(tmp_path, monkeypatch):
    """40k entries (625 top entries, 10 root blocks): a lookup of one key reads the root and one top block,
    not the top index whole (the tail read made small, as the top of a table of millions outgrows it); a run
    of 5,000 keys sharing one key64 spans a block boundary (its first page is in the block before the one the
    root points at) and every key of it is found. The same table without its root (as written before roots
    existed) answers the same, reading the top whole; compaction writes it again with a root."""
    monkeypatch.setattr(cache_table, "TAIL_BYTES", 1024)
    cache = ResultCache(Location(str(tmp_path)), "ns")
    same = [f"{'7f' * 8}{i:048x}" for i in range(5000)]
    entries = [{"key": k, "output": k} for k in same] + [{"key": _key(i), "output": _output(i)} for i in range(35_000)]
    name = cache.write_table(entries)["name"]
    (table,) = cache.tables()
    f = cache_table.parse_footer(table, cache.dir.child(name).path().read_bytes())
    assert f[8] == 625 and cache_table.root_span(table, f) is not None
    others = {_key(i): _output(i) for i in range(0, 35_000, 3500)}
    want = same[::499] + [same[-1], same[0]] + list(others) + [_key(10**6)]
    expect = {**{k: k for k in same[::499] + [same[-1], same[0]]}, **others}
    one_key = []
    for rootless in (False, True):
        if rootless:
            _strip_root(cache, name)
        found = {e["key"]: e["output"] for e in cache.lookup(want)}
        assert found == expect
        run = same[::499] + [same[0], same[-1]]  # alone: no other key's top block is read with theirs
        assert sorted(e["key"] for e in cache.lookup(run)) == sorted(set(run))
        lk = cache.lookup([_key(7000)])
        assert [e["key"] for e in lk] == [_key(7000)]
        one_key.append(lk.stats["bytes_read"])
    # the top whole (less what the tail read held) against one block of it
    assert one_key[1] - one_key[0] > 8 * 625 - 1024 - 512, one_key
    cache.write_table([{"key": _key(10**6), "output": "x"}])
    cache.maintain(max_age_days=None, compact_after_tables=2, max_runs=8)
    (run,) = cache.tables()
    assert cache_table.root_span(run, cache_table.parse_footer(run, cache.dir.child(run.name).path().read_bytes()))
    assert {e["key"]: e["output"] for e in cache.lookup(want)} == {**expect, _key(10**6): "x"}


def test_write_table_sorts_in_bounded_runs_and_keeps_the_newest(tmp_path, monkeypatch):
    monkeypatch.setattr(result_cache, "SORT_RUN_ENTRIES", 1000)  # spills 10 runs
    cache = ResultCache(Location(str(tmp_path)), "ns", clock=lambda: T0)
    order = list(range(5000))
    random.Random(3).shuffle(order)
    stale = [{**_entry(i, T0 - DAY), "output": "stale"} for i in range(0, 5000, 10)]
    info = cache.write_table([_entry(i, T0) for i in order] + stale)
    assert info["entries"] == 5000
    _check(list(cache.lookup(_key(i) for i in range(5000))), set(range(5000)))


# ------------------------------------------------------------------------------------------ retention
def test_expired_entries_miss_and_are_dropped_at_compaction(tmp_path):
    now = [T0]
    cache = ResultCache(Location(str(tmp_path)), "ns", max_age_days=30, clock=lambda: now[0])
    cache.write_table(_entry(i, T0 - 40 * DAY) for i in range(100))               # all expired
    cache.write_table([_entry(i, T0 - 40 * DAY) for i in range(100, 200)] +       # half expired
                      [_entry(i, T0 - 10 * DAY) for i in range(200, 300)])
    lk = cache.lookup(_key(i) for i in range(300))
    _check(list(lk), set(range(200, 300)))
    assert lk.stats["tables"] == 1 and lk.stats["expired"] == 100  # the dead table is not even opened
    s = cache.maintain(max_age_days=30, compact_after_tables=2, max_runs=8)
    assert s["expired_tables_deleted"] == 1 and s["tables_merged"] == 0  # one shard table left: below 2
    now[0] = T0 + 15 * DAY
    cache.write_table(_entry(i, now[0]) for i in range(300, 310))
    s = cache.maintain(max_age_days=30, compact_after_tables=2, max_runs=8)
    assert s["expired_entries_dropped"] == 100 and s["entries_written"] == 110 and s["tables_after"] == 1, s
    _check(list(cache.lookup(_key(i) for i in range(310))), set(range(200, 310)))
    now[0] = T0 + 100 * DAY
    s = cache.maintain(max_age_days=30, compact_after_tables=2, max_runs=8)
    # the dead table's footer alone is read (one range from its end) to confirm it before it is deleted
    assert s["expired_tables_deleted"] == 1 and s["ranges_read"] == 1 and cache.tables() == []


def test_compaction_keeps_the_object_count_bounded_over_many_days(tmp_path):
    """60 simulated days, 5 shards a day; retention 20 days; maintain after each day."""
    now = [T0]
    cache = ResultCache(Location(str(tmp_path)), "ns", max_age_days=20, clock=lambda: now[0])
    written: dict[int, float] = {}  # entry -> day written (latest)
    rng = random.Random(5)
    peak = 0
    for day in range(60):
        now[0] = T0 + day * DAY
        for shard in range(5):
            ids = [day * 1000 + shard * 100 + j for j in range(60)]
            ids += rng.sample(sorted(written), min(10, len(written)))  # regenerated again (duplicates)
            cache.write_table(_entry(i) for i in ids)
            for i in ids:
                written[i] = now[0]
        peak = max(peak, len(cache.tables()))
        s = cache.maintain(max_age_days=20, compact_after_tables=8, max_runs=3)
        assert s["aborted"] is None
        tables = cache.tables()
        assert len(tables) <= 8 - 1 + 3, [t.name for t in tables]
        assert sum(t.kind == "r" for t in tables) <= 3
        if day % 10 == 9:
            live = {i for i, t in written.items() if t >= now[0] - 20 * DAY}
            _check(list(cache.lookup(_key(i) for i in written)), live)
    assert peak <= 8 - 1 + 3 + 5


def test_compaction_merges_in_small_blocks_what_a_reference_merge_keeps(tmp_path, monkeypatch):
    """Blocks of 64 entries (the budget made tiny), gathered a few at a time: 10 tables, each rewriting keys 0..99
    and holding 150 of 300 keys sharing one key64 (runs over block boundaries, in several tables), each entry 0-59
    days old against a 30-day cutoff: the newest entry of a key wins, then is dropped if expired. Compared with a
    merge by hand."""
    from batch_llm.cache import merge

    monkeypatch.setattr(merge, "BUDGET_BYTES", 1)
    monkeypatch.setattr(merge, "MIN_BLOCK_BYTES", 1)
    monkeypatch.setattr(merge, "GATHER_BYTES", 500)  # a few lines gathered at a time
    now = T0 + 100 * DAY
    cache = ResultCache(Location(str(tmp_path)), "ns", clock=lambda: now)
    same = [f"{'5a' * 8}{i:048x}" for i in range(300)]
    expect: dict[str, tuple[float, str]] = {}
    for d in range(10):
        keys = [_key(i) for i in range(100)] + same[d * 15:d * 15 + 150] + [_key(i) for i in range(1000 + 50 * d, 1050 + 50 * d)]
        rows = [{"key": k, "output": f"{d}/{j}", "t": now - ((j * 7 + d * 13) % 60) * DAY - d} for j, k in enumerate(keys)]
        cache.write_table(rows)
        for r in rows:
            if r["key"] not in expect or expect[r["key"]][0] < r["t"]:
                expect[r["key"]] = (r["t"], r["output"])
    keep = {k: o for k, (t, o) in expect.items() if t >= now - 30 * DAY}
    s = cache.maintain(max_age_days=30, compact_after_tables=2, max_runs=8)
    assert s["tables_merged"] == 10 and s["entries_written"] == len(keep), s
    assert s["entries_in"] == 10 * 300 and s["duplicates_dropped"] + s["expired_entries_dropped"] == 3000 - len(keep)
    (run,) = cache.tables()
    found = {e["key"]: e["output"] for e in cache.lookup(list(expect))}
    assert found == keep
    # The run is one sorted table: its entries in (key64, key) order, every key once.
    reader = cache_table.RangeReader(None, True, {"ranges_read": 0, "bytes_read": 0})
    (m,), _ = cache_table.open_tables(reader, [run])
    lines = reader.read_one(run.path, 0, m.values_len).splitlines()
    items = [cache_table.merge_item(x)[:2] for x in lines]
    assert items == sorted(set(items)) and len(items) == len(keep)


# ------------------------------------------------------------------------------------------ concurrency
def _fill(cache: ResultCache, n_tables: int, per: int, start: int = 0) -> set[int]:
    ids = set()
    for t in range(n_tables):
        batch = range(start + t * per, start + (t + 1) * per)
        cache.write_table(_entry(i) for i in batch)
        ids.update(batch)
    return ids


def test_a_writer_during_compaction_loses_nothing(tmp_path):
    cache = ResultCache(Location(str(tmp_path)), "ns")
    ids = _fill(cache, 4, 200)
    merge = cache._merge

    def a_shard_commits_then_merge(inputs, cutoff, stats):  # after the listing, before the merge
        ids.update(_fill(cache, 1, 200, start=10_000))
        return merge(inputs, cutoff, stats)

    cache._merge = a_shard_commits_then_merge
    s = cache.maintain(max_age_days=None, compact_after_tables=2, max_runs=8)
    assert s["tables_merged"] == 4 and s["tables_after"] == 2  # the run, and the table written meanwhile
    assert sorted(t.kind for t in cache.tables()) == ["r", "s"]
    _check(list(cache.lookup(_key(i) for i in ids)), ids)


def test_racing_compactions_and_writers_lose_nothing(tmp_path):
    cache = ResultCache(Location(str(tmp_path)), "ns")
    ids = _fill(cache, 6, 100)
    errors: list[BaseException] = []
    lock = threading.Lock()

    def writer(w):
        try:
            for t in range(6):
                batch = range(100_000 * (w + 1) + t * 100, 100_000 * (w + 1) + (t + 1) * 100)
                cache.write_table(_entry(i) for i in batch)
                with lock:
                    ids.update(batch)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    def compactor():
        try:
            for _ in range(6):
                cache.maintain(max_age_days=None, compact_after_tables=2, max_runs=1)
                # a reader at any moment finds every committed entry, and only right ones
                with lock:
                    snapshot = set(ids)
                lk = cache.lookup(_key(i) for i in snapshot)
                found = list(lk)
                _check(found, {i for i in snapshot if _key(i) in {e["key"] for e in found}})  # only right ones
                assert len(found) == len(snapshot) or lk.stats["retried"], lk.stats  # a miss only after a retry
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(2)]
    threads += [threading.Thread(target=compactor) for _ in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors, errors
    cache.maintain(max_age_days=None, compact_after_tables=2, max_runs=1)
    assert len(cache.tables()) <= 2
    _check(list(cache.lookup(_key(i) for i in ids)), ids)


def test_a_lookup_that_meets_a_deleted_table_lists_again(tmp_path):
    cache = ResultCache(Location(str(tmp_path)), "ns")
    ids = _fill(cache, 4, 300)
    lk = cache.lookup(_key(i) for i in ids)  # lists the 4 shard tables now
    cache.maintain(max_age_days=None, compact_after_tables=2, max_runs=8)  # merges them and deletes them
    _check(list(lk), ids)
    assert lk.stats["retried"] and lk.stats["tables"] == 5


def test_legacy_segments_are_folded_into_a_table(tmp_path):
    cache = ResultCache(Location(str(tmp_path)), "ns")
    write_jsonl(cache.dir.child("seg-0123.jsonl").path(), [{k: v for k, v in _entry(i).items()} for i in range(50)])
    assert list(cache.lookup([_key(1)])) == []
    s = cache.maintain(max_age_days=90, compact_after_tables=64, max_runs=8)
    assert s["legacy_segments_folded"] == 1
    _check(list(cache.lookup(_key(i) for i in range(60))), set(range(50)))
    assert result_cache.maintain_all(Location(str(tmp_path)))["ns"]["tables_after"] == 1


# ------------------------------------------------------------------------------------------ what maintenance may delete
def _newer_format_table(cache: ResultCache, entries: list[dict]) -> str:
    """A table as a newer worker might write it: the same name scheme, a footer version this one cannot read."""
    info = cache.write_table(entries)
    path = cache.dir.child(info["name"]).path()
    data = bytearray(path.read_bytes())
    data[len(data) - cache_table.FOOTER.size + 8:len(data) - cache_table.FOOTER.size + 12] = \
        (cache_table.VERSION + 1).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    return info["name"]


def test_a_table_it_cannot_read_is_kept_not_merged_nor_expired(tmp_path):
    now = [T0]
    cache = ResultCache(Location(str(tmp_path)), "ns", clock=lambda: now[0])
    ids = _fill(cache, 2, 50)
    newer = _newer_format_table(cache, [_entry(i, T0) for i in range(1000, 1010)])
    s = cache.maintain(max_age_days=None, compact_after_tables=2, max_runs=8)
    assert s["tables_merged"] == 2 and s["unreadable_tables_kept"] == [newer], s
    assert sorted(t.name for t in cache.tables() if t.kind == "s") == [newer]
    _check(list(cache.lookup(_key(i) for i in ids)), ids)
    old = _newer_format_table(cache, [_entry(i, T0 - 40 * DAY) for i in range(2000, 2010)])  # expired by name
    s = cache.maintain(max_age_days=30, compact_after_tables=64, max_runs=8)
    assert s["expired_tables_deleted"] == 0 and s["unreadable_tables_kept"] == [old], s
    assert {newer, old} <= {t.name for t in cache.tables()}


def _old_table(root: Location, ns: str) -> ResultCache:
    """A namespace holding one table written 40 days ago (by the wall clock maintenance goes by)."""
    import time

    cache = ResultCache(root, ns)
    cache.write_table(_entry(i, time.time() - 40 * DAY) for i in range(20))
    return cache


def test_each_namespace_is_maintained_with_its_own_writers_settings(tmp_path):
    root = Location(str(tmp_path))
    caches = {ns: _old_table(root, ns) for ns in ("monthly", "forever", "shared", "unrecorded")}
    result_cache.record_retention(root, "monthly", "p30", max_age_days=30, compact_after_tables=64, max_runs=8)
    result_cache.record_retention(root, "forever", "pkeep", max_age_days=None, compact_after_tables=64, max_runs=8)
    for pipeline, age in (("p30", 30), ("pkeep", None)):  # two pipelines write one namespace: the longest wins
        result_cache.record_retention(root, "shared", pipeline, max_age_days=age, compact_after_tables=64, max_runs=8)
    got = result_cache.maintain_all(root)
    assert {ns: len(c.tables()) for ns, c in caches.items()} == {"monthly": 0, "forever": 1, "shared": 1,
                                                                 "unrecorded": 1}, got
    assert got["shared"]["settings"]["pipelines"] == ["p30", "pkeep"]
    assert got["unrecorded"]["settings"]["max_age_days"] is None


def test_a_namespace_whose_record_it_cannot_read_is_left_alone(tmp_path):
    root = Location(str(tmp_path))
    cache = _old_table(root, "ns")
    result_cache.record_retention(root, "ns", "p30", max_age_days=30, compact_after_tables=64, max_runs=8)
    write_jsonl(cache.dir.child("_retention.newer.json").path(), [{"format": 2, "pipeline": "newer"}])
    got = result_cache.maintain_all(root)
    assert "_retention.newer.json" in got["ns"]["skipped"] and len(cache.tables()) == 1


def _publish_maintenance(tmp_path, **cache_settings) -> tuple:
    """maintain_cache as publish calls it, for a run whose one shard looked up (and wrote) namespace "mine"."""
    from batch_llm.manifests import ShardManifest, ShardMetrics

    cfg = demo_config(tmp_path, **{f"cache__{k}": v for k, v in cache_settings.items()})
    layout = RunLayout.for_run(cfg, run_id="manual__cache", ds="2026-01-01")
    ShardManifest(shard=0, outputs="o", errors="e", metrics=ShardMetrics(rows=0), checksum="c",
                  cache_lookup={"namespace": "mine", "keys": 0}).write(layout.stage("infer").child("shard-00000").path())
    return cfg, layout, layout.cache_root(cfg)


def test_publish_expires_by_each_namespaces_own_settings(tmp_path):
    cfg, layout, root = _publish_maintenance(tmp_path, max_age_days=30)
    mine, other = _old_table(root, "mine"), _old_table(root, "other")
    result_cache.record_retention(root, "other", "keeps_forever", max_age_days=None, compact_after_tables=64,
                                  max_runs=8)
    got = api.maintain_cache(cfg, layout)
    assert got["recorded"] == ["mine"] and mine.tables() == [], got
    assert len(other.tables()) == 1, got  # another pipeline's "keep forever" is not overridden by this one's 30 days
    assert result_cache.recorded_settings(mine)["pipelines"] == [cfg.name]


def test_publish_cache_maintenance_never_raises(tmp_path, monkeypatch):
    cfg, layout, root = _publish_maintenance(tmp_path)

    def broken(*a, **k):
        raise OSError("the store is down")

    monkeypatch.setattr(result_cache, "maintain_all", broken)
    assert api.maintain_cache(cfg, layout) == {"error": "OSError: the store is down"}
    monkeypatch.undo()
    monkeypatch.setattr(ResultCache, "maintain", broken)
    got = api.maintain_cache(cfg, layout)
    assert got["namespaces"] == {} or all("error" in s for s in got["namespaces"].values()), got
    _old_table(root, "a")
    assert api.maintain_cache(cfg, layout)["namespaces"]["a"]["error"] == "OSError: the store is down"


# ------------------------------------------------------------------------------------------ on S3
def test_range_reads_and_compaction_on_s3(s3):
    """Shard tables of ~6 MiB (one PUT each), then their compacted run (~20 MiB, a multipart upload: SeaweedFS
    serves a range of such an object at ~50 ms, so the run is read with few ranges here)."""
    root = Location(f"s3://{s3.bucket}/cache-test", s3.storage_options())
    cache = ResultCache(root, "ns")
    ids = _fill(cache, 3, 12_000)
    total = sum(t.size for t in cache.tables())
    present = set(random.Random(2).sample(sorted(ids), 200))
    lk = cache.lookup([_key(i) for i in present] + [_key(-i) for i in range(1, 201)])
    _check(list(lk), present)
    assert lk.stats["objects_read"] <= 3 and lk.stats["bytes_read"] < 0.10 * total, lk.stats
    # a compaction deletes the tables under a listed lookup: it lists again and finds the run
    few = set(sorted(present)[:40])
    lk = cache.lookup(_key(i) for i in few)
    s = cache.maintain(max_age_days=90, compact_after_tables=2, max_runs=8)
    assert s["tables_merged"] == 3 and s["tables_after"] == 1 and s["entries_written"] == 36_000
    _check(list(lk), few)
    assert lk.stats["retried"]
    assert [t.kind for t in cache.tables()] == ["r"]
    _check(list(cache.lookup(_key(i) for i in ids)), ids)


def test_length_records_beside_the_cache_on_s3(s3):
    """The output-length records (cache/lengths.py) on an S3 server: written whole, the oldest deleted past the
    kept number, the newest read back and merged; the cache's maintenance takes their folder for no namespace."""
    from batch_llm.cache.lengths import HISTORY_LEVELS, LengthHistory, LengthRecorder
    from batch_llm.rows.prefix import prefix_groups, prompt_bytes

    root = Location(f"s3://{s3.bucket}/cache-lengths", s3.storage_options())
    store = root.child("lengths", "k")
    group = prefix_groups(prompt_bytes("Summarize the following report for a reader who has not seen it: " * 2,
                                       None, None), HISTORY_LEVELS)
    for tokens in (100, 200, 300):
        rec = LengthRecorder()
        for _ in range(4):
            rec.add(group, tokens)  # type: ignore[arg-type]
        rec.write(store, keep=2)
    assert len(list(store.path().iterdir())) == 2  # the first record deleted
    h = LengthHistory.load(store)
    assert h is not None and h.files == 2 and h.estimate(group, 1000) == 250  # type: ignore[arg-type]
    assert result_cache.maintain_all(root) == {}
