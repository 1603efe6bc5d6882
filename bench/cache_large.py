"""The result cache at 100M-rows-a-day scale: a cache of ``--entries`` entries (300M by default) built directly,
a shard's keys looked up against it, then compaction of all of it into one run.

The cache is **generated**: tiny entries (``{"key": <16 hex digits>, "t": ..., "output": "ok"}``, 56 bytes a value
line, 72 with the index), keys spread evenly over the key space (entry i's key64 is i times the stride plus a
hash of i below it), in ``--tables`` runs (run j holds the entries i = j mod tables, each written a day after the
one before), each written in blocks through the cache's own ``TableWriter`` (``add_block``): the format is the
library's, only the sorting is skipped (the keys are generated in order). Then, each step in a fresh process (its
own peak RSS):

  lookup     a shard's ``--shard-keys`` keys, once all cached (a backfill: sampled uniformly over every entry)
             and once none (a new day): seconds, bytes read and their share of the cache, peak RSS
  compact    ``maintain`` merging every run into one (the external merge: bounded memory): seconds, peak RSS
  lookup     the same keys against the one compacted run

    .venv/bin/python -m bench cache-large --entries 30000000          # ~2 GiB of disk, a few minutes
    .venv/bin/python -m bench cache-large                             # 300M: ~20 GiB, twice that while compacting

Prints a markdown table; writes JSON to bench/results/cache_large-<time>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from batch_llm.cache.results import ResultCache
from batch_llm.cache.table import TableWriter, table_name
from batch_llm.io.storage import Location

from bench.runners import RESULTS, bench_command, child_env

T0 = 1_800_000_000
DAY = 86_400
NS = "generated"
BLOCK = 1 << 21  # entries generated and written at once
_HEX = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)
_LINE = b'{"key":"%s","t":%d,"output":"ok"}\n'


def _mix(i: np.ndarray) -> np.ndarray:
    """splitmix64 of each i: the in-stride offset of entry i's key (numpy's uint64 arithmetic wraps)."""
    with np.errstate(over="ignore"):
        z = i.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def key64s(i: np.ndarray, n: int, miss: bool = False) -> np.ndarray:
    """Entry i's key64, ascending in i; ``miss``: a key64 in entry i's stride that no entry has."""
    stride = np.uint64((2**64 - 1) // n)
    off = _mix(i) % stride
    if miss:
        off = (off + stride // np.uint64(2)) % stride
    with np.errstate(over="ignore"):
        return i.astype(np.uint64) * stride + off


def hex16(k: np.ndarray) -> np.ndarray:
    """(len(k), 16) uint8: each key64 as 16 lowercase hex digits."""
    b = k.astype(">u8").view(np.uint8).reshape(-1, 8)
    return _HEX[np.stack([b >> 4, b & 15], axis=-1).reshape(-1, 16)]


def build(root: str, n: int, tables: int) -> dict:
    cache = ResultCache(Location(root), NS)
    os.makedirs(os.path.join(root, NS), exist_ok=True)
    for j in range(tables):
        t = T0 + j * DAY
        template = np.frombuffer(_LINE % (b"0" * 16, t), dtype=np.uint8)
        ids = np.arange(j, n, tables, dtype=np.uint64)
        with tempfile.TemporaryDirectory(prefix="cache_large_") as tmp:
            w = TableWriter(cache.dir.child(table_name("r", t)).path(), tmp)
            for a in range(0, len(ids), BLOCK):
                k = key64s(ids[a:a + BLOCK], n)
                lines = np.tile(template, (len(k), 1))
                lines[:, 8:24] = hex16(k)
                w.add_block(k, np.full(len(k), len(template)), lines.tobytes(), t, t)
            w.commit()
        print(f"table {j + 1}/{tables} written", file=sys.stderr, flush=True)
    return {"tables": len(cache.tables()), "cache_bytes": sum(x.size for x in cache.tables())}


def shard_keys(n: int, count: int, miss: bool) -> list[str]:
    ids = np.unique(np.random.default_rng(1).integers(0, n, size=count, dtype=np.uint64))
    return [x.decode() for x in hex16(key64s(ids, n, miss)).view("S16").ravel()]


def lookup(root: str, n: int, count: int, miss: bool) -> dict:
    keys = shard_keys(n, count, miss)
    lk = ResultCache(Location(root), NS).lookup(keys)
    hits = sum(1 for _ in lk)
    s = dict(lk.stats)
    assert hits == (0 if miss else len(keys)), (hits, len(keys))
    return {**s, "share_of_cache_bytes": s["bytes_read"] / s["cache_bytes"] if s["cache_bytes"] else 0.0}


def compact(root: str) -> dict:
    return ResultCache(Location(root), NS).maintain(max_age_days=None, compact_after_tables=2, max_runs=1)


def step(args, name: str, **kw) -> dict:
    """One step in a fresh process: its result, seconds and peak RSS."""
    extra = [f"--{k.replace('_', '-')}={v}" for k, v in kw.items()]
    out = subprocess.run(bench_command("cache-large", "--step", name, "--root", args.root, "--entries", args.entries,
                                       "--tables", args.tables, "--shard-keys", args.shard_keys, *extra),
                         env=child_env(), check=True, stdout=subprocess.PIPE, text=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    print(f"{name} {kw}: {r['wall_seconds']} s, peak RSS {r['peak_rss_mb']} MB", file=sys.stderr, flush=True)
    return r


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--entries", type=int, default=300_000_000)
    ap.add_argument("--tables", type=int, default=10, help="runs the cache is built as (merged by compaction)")
    ap.add_argument("--shard-keys", type=int, default=100_000, help="keys a shard looks up")
    ap.add_argument("--root", help="cache folder (default: a temporary one, removed at the end)")
    ap.add_argument("--step", choices=("build", "lookup", "compact"), help=argparse.SUPPRESS)
    ap.add_argument("--miss", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(RESULTS / f"cache_large-{time.strftime('%Y%m%dT%H%M%S')}.json"))
    args = ap.parse_args(argv)
    if args.step:
        t = time.perf_counter()
        r = (build(args.root, args.entries, args.tables) if args.step == "build" else
             lookup(args.root, args.entries, args.shard_keys, bool(args.miss)) if args.step == "lookup" else
             compact(args.root))
        r.update(wall_seconds=round(time.perf_counter() - t, 2),
                 peak_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1))
        print(json.dumps(r))
        return
    own = not args.root
    args.root = args.root or tempfile.mkdtemp(prefix="cache_large_")
    res: dict = {"generated": True, "config": vars(args), "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
    try:
        res["build"] = step(args, "build")
        res["lookup"] = {"runs": {"backfill": step(args, "lookup", miss=0), "new day": step(args, "lookup", miss=1)}}
        res["compact"] = step(args, "compact")
        res["lookup"]["compacted"] = {"backfill": step(args, "lookup", miss=0), "new day": step(args, "lookup", miss=1)}
    finally:
        if own:
            shutil.rmtree(args.root, ignore_errors=True)
    b, c = res["build"], res["compact"]
    print(f"\nResult cache, {args.entries:,} generated entries ({b['cache_bytes'] / 2**30:.1f} GiB, {b['tables']} runs), "
          f"local disk; a shard of {args.shard_keys:,} keys:\n")
    print("| step | layout | seconds | bytes read | share of cache | peak RSS |")
    print("|---|---|---:|---:|---:|---:|")
    print(f"| build | {b['tables']} runs | {b['wall_seconds']:.0f} | | | {b['peak_rss_mb']:.0f} MB |")
    for layout, name in (("runs", f"{b['tables']} runs"), ("compacted", "1 run")):
        for case, s in res["lookup"][layout].items():
            print(f"| lookup, {case} | {name} | {s['seconds']:.2f} | {s['bytes_read'] / 2**20:,.1f} MiB "
                  f"| {s['share_of_cache_bytes']:.3%} | {s['peak_rss_mb']:.0f} MB |")
    print(f"| compaction ({c['entries_in']:,} entries) | {b['tables']} runs → 1 | {c['seconds']:.0f} | "
          f"{c['bytes_read'] / 2**30:.1f} GiB | | {c['peak_rss_mb']:.0f} MB |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
