"""Scale benchmark of the result cache: what a run's lookup costs as the cache's history grows.

The cache is **synthesized**: entries of the shape the shard runner writes (a sha256 key, an output of ~400
characters of random text, finish reason, token counts), written as daily tables (``--day-rows`` entries a
day, in ``--shards-per-day`` shard tables), with ``maintain`` after each day as the publish task runs it
(``--compact-after-tables``, ``--max-runs``, ``--max-age-days``: the CacheConfig defaults). At each size of
``--sizes`` a run of ``--run-rows`` keys is looked up twice:

  all-hit   the run's keys are all in the cache (a backfill), sampled uniformly over the whole history, so
            they are spread over every table: the hard case for a point lookup
  all-miss  none is (a new day)

and its seconds, bytes read, objects read, range requests and share of the cache's bytes are recorded.
Sizes are built incrementally (the 30M cache is the 1M one plus 29 more days). ``--also-compacted`` merges the
cache into one run afterwards and measures again. Local caches are read through the OS page cache (the
tables were just written), so local seconds are mostly CPU; ``--s3`` runs against SeaweedFS on loopback.

    .venv/bin/python -m bench scale-cache                         # 1M and 30M entries (~17 GB of disk)
    .venv/bin/python -m bench scale-cache --sizes 100000,1000000 --run-rows 100000

Prints a markdown table; writes JSON to bench/results/scale_cache-<time>.json.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from batch_llm.cache.results import ResultCache
from batch_llm.config import CacheConfig
from batch_llm.io.storage import Location

from bench.runners import RESULTS, ROOT

DAY = 86400.0
T0 = 1_800_000_000.0
MISS_OFFSET = 10**12
_POOL = "".join(random.Random(7).choices("abcdefghijklmnopqrstuvwxyz     .,", k=1 << 22))


def key(i: int) -> str:
    return hashlib.sha256(f"synthesized-prompt-{i}".encode()).hexdigest()


def entry(i: int, t: float) -> dict:
    o = (i * 2654435761) % (len(_POOL) - 420)
    return {"key": key(i), "t": int(t), "output": _POOL[o:o + 380 + i % 40], "finish_reason": "stop",
            "prompt_tokens": 40 + i % 200, "completion_tokens": 90 + i % 20}


def measure(cache: ResultCache, keys: list[str], expect_hits: int) -> dict:
    lk = cache.lookup(keys)
    hits = sum(1 for _ in lk)
    s = dict(lk.stats)
    assert hits == expect_hits, (hits, expect_hits)
    s["share_of_cache_bytes"] = s["bytes_read"] / s["cache_bytes"] if s["cache_bytes"] else 0.0
    return s


def main(argv: list[str] | None = None) -> None:  # noqa: C901
    d = CacheConfig()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1000000,30000000", help="cache entries, comma-separated")
    ap.add_argument("--run-rows", type=int, default=1_000_000, help="keys the measured run looks up")
    ap.add_argument("--day-rows", type=int, default=1_000_000, help="entries written a day")
    ap.add_argument("--shards-per-day", type=int, default=1, help="shard tables a day's entries are split in")
    ap.add_argument("--compact-after-tables", type=int, default=d.compact_after_tables)
    ap.add_argument("--max-runs", type=int, default=d.max_runs)
    ap.add_argument("--max-age-days", type=float, default=d.max_age_days)
    ap.add_argument("--also-compacted", action="store_true", help="then merge into one run and measure again")
    ap.add_argument("--root", help="cache folder (default: a temporary one, removed at the end)")
    ap.add_argument("--s3", action="store_true", help="against SeaweedFS on loopback (tests/s3_server.py)")
    ap.add_argument("--out", default=str(RESULTS / f"scale_cache-{time.strftime('%Y%m%dT%H%M%S')}.json"))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    sizes = sorted(int(x) for x in args.sizes.split(","))

    tmp = tempfile.mkdtemp(prefix="scale_cache_")
    server = None
    if args.s3:
        sys.path.insert(0, str(ROOT / "tests"))  # s3_server (batch_llm itself: the installed package)
        from s3_server import S3Server

        server = S3Server(Path(tmp) / "s3", bucket="scale-cache").start()
        root = Location(f"s3://{server.bucket}/cache", server.storage_options())
    else:
        root = Location(args.root or os.path.join(tmp, "cache"))
    now = [T0]
    cache = ResultCache(root, "synthetic", max_age_days=args.max_age_days, clock=lambda: now[0])
    rng = random.Random(args.seed)
    results: dict = {"synthesized": True, "config": vars(args), "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
               "storage": "s3 (SeaweedFS, loopback)" if args.s3 else "local disk", "sizes": []}
    written, day, write_s, maintain_s = 0, 0, 0.0, 0.0
    maintains: list[dict] = []
    t_all = time.perf_counter()
    try:
        for size in sizes:
            while written < size:  # one more day: its shard tables, then maintenance
                now[0] = T0 + day * DAY
                n = min(args.day_rows, size - written)
                per = -(-n // args.shards_per_day)
                t = time.perf_counter()
                for a in range(written, written + n, per):
                    cache.write_table(entry(i, now[0]) for i in range(a, min(a + per, written + n)))
                write_s += time.perf_counter() - t
                written += n
                day += 1
                m = cache.maintain(max_age_days=args.max_age_days, compact_after_tables=args.compact_after_tables,
                                   max_runs=args.max_runs)
                maintain_s += m["seconds"]
                if m["tables_merged"] or m["expired_tables_deleted"]:
                    maintains.append({"day": day, **m})
                print(f"day {day}: {written:,} entries, {len(cache.tables())} tables", file=sys.stderr, flush=True)
            layouts: list[tuple[str, bool]] = [("maintained", False)]
            if args.also_compacted and size == sizes[-1]:
                layouts.append(("compacted", True))
            for layout, compact in layouts:
                if compact:
                    m = cache.maintain(max_age_days=args.max_age_days, compact_after_tables=2, max_runs=1)
                    maintains.append({"day": day, "forced": True, **m})
                tables = cache.tables()
                run = min(args.run_rows, written)
                hit_keys = [key(i) for i in rng.sample(range(written), run)]
                miss_keys = [key(MISS_OFFSET + day * 10**7 + i) for i in range(args.run_rows)]
                row: dict[str, Any] = {"entries": written, "days": day, "layout": layout, "tables": len(tables),
                       "runs": sum(t.kind == "r" for t in tables), "cache_bytes": sum(t.size for t in tables),
                       "write_seconds_so_far": round(write_s, 1), "maintain_seconds_so_far": round(maintain_s, 1),
                       "all_hit": measure(cache, hit_keys, run), "all_miss": measure(cache, miss_keys, 0)}
                del hit_keys, miss_keys
                results["sizes"].append(row)
                print(f"size {written:,} ({layout}): hit {row['all_hit']['seconds']}s, miss {row['all_miss']['seconds']}s",
                      file=sys.stderr, flush=True)
    finally:
        if server is not None:
            server.stop()
        if not args.root:
            shutil.rmtree(tmp, ignore_errors=True)
    results["maintenance"] = maintains
    results["seconds"] = round(time.perf_counter() - t_all, 1)
    results["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)

    print(f"\nResult cache, synthesized entries (~400-character outputs), {results['storage']}; "
          f"a run of {args.run_rows:,} keys looked up:\n")
    print("| cache entries | layout | tables (runs) | cache size | run | hits | seconds | bytes read | share of cache "
          "| objects read | range requests |")
    print("|---:|---|---:|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in results["sizes"]:
        for name in ("all_hit", "all_miss"):
            s = r[name]
            print(f"| {r['entries']:,} | {r['layout']} | {r['tables']} ({r['runs']}) | {r['cache_bytes'] / 2**30:.2f} GiB "
                  f"| {name.replace('_', '-')} | {s['hits']:,} | {s['seconds']:.2f} | {s['bytes_read'] / 2**20:,.1f} MiB "
                  f"| {s['share_of_cache_bytes']:.1%} | {s['objects_read']} | {s['ranges_read']:,} |")
    print(f"\nwhole benchmark {results['seconds']} s (writes {write_s:.0f} s, maintenance {maintain_s:.0f} s), "
          f"peak RSS {results['peak_rss_mb']} MB")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {out}")

