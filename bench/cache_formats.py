"""The result cache's own table format against sorted Parquet (pyarrow, statistics, page index, bloom filters on
the key) read through ``pyarrow.dataset`` and DuckDB: the same entries, the same wanted keys, bytes read and time.

The entries are ``scale_cache``'s synthesized ones (a sha256 key, ~400 characters of output, finish reason, token
counts), ``--entries`` of them; a run of ``--run-rows`` keys is looked up twice: every key cached (a backfill,
sampled uniformly: the density 1M keys against 30M entries has at the defaults' 100k against 3M) and none (a new
day). Bytes read are the process's own (``rchar`` of /proc/self/io: every read call, page cache or not; the
readers' threads included), as a share of the bytes the format stores.

    .venv/bin/python -m bench cache-formats                         # 3M entries, 100k keys (~4 GB of disk)
    .venv/bin/python -m bench cache-formats --entries 30000000 --run-rows 1000000

Prints a markdown table; writes JSON to bench/results/cache_formats-<time>.json.
"""
from __future__ import annotations

import argparse
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
from batch_llm.io.storage import Location

from bench.runners import RESULTS
from bench.scale_cache import MISS_OFFSET, T0, entry, key


def rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def timed_read(fn) -> tuple[int, float, int]:
    """(rows found, seconds, bytes read) of ``fn()``."""
    b0, t0 = rchar(), time.perf_counter()
    n = fn()
    return n, round(time.perf_counter() - t0, 3), rchar() - b0


def write_parquet(path: str, n: int, row_group: int, bloom: bool) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([("key", pa.string()), ("t", pa.int64()), ("output", pa.string()),
                        ("finish_reason", pa.string()), ("prompt_tokens", pa.int32()),
                        ("completion_tokens", pa.int32())])
    order = sorted(range(n), key=key)  # sorted by key: row-group statistics then bound each group's keys
    opts = {"bloom_filter_options": {"key": {"ndv": n, "fpp": 0.01}}} if bloom else {}
    with pq.ParquetWriter(path, schema, write_page_index=True, sorting_columns=[pq.SortingColumn(0)],
                          **opts) as w:
        for a in range(0, n, row_group):
            rows = [entry(i, T0) for i in order[a:a + row_group]]
            w.write_table(pa.Table.from_pylist(rows, schema=schema), row_group_size=row_group)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--entries", type=int, default=3_000_000)
    ap.add_argument("--run-rows", type=int, default=100_000)
    ap.add_argument("--row-groups", default="65536,4096",
                    help="Parquet row-group sizes (rows), comma-separated; empty: the own format only")
    ap.add_argument("--root", help="folder (default: a temporary one, removed at the end)")
    ap.add_argument("--out", default=str(RESULTS / f"cache_formats-{time.strftime('%Y%m%dT%H%M%S')}.json"))
    args = ap.parse_args(argv)
    import duckdb
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.dataset as ds

    tmp = args.root or tempfile.mkdtemp(prefix="cache_formats_")
    os.makedirs(tmp, exist_ok=True)
    rng = random.Random(0)
    hit = [key(i) for i in rng.sample(range(args.entries), args.run_rows)]
    miss = [key(MISS_OFFSET + i) for i in range(args.run_rows)]
    rows: list[dict[str, Any]] = []
    try:
        cache = ResultCache(Location(os.path.join(tmp, "sst")), "ns")
        t = time.perf_counter()
        cache.write_table(entry(i, T0) for i in range(args.entries))
        write_s = time.perf_counter() - t
        size = sum(x.size for x in cache.tables())
        for case, keys in (("backfill", hit), ("new day", miss)):
            n, s, b = timed_read(lambda keys=keys: sum(1 for _ in cache.lookup(keys)))
            rows.append({"format": "own table (sst)", "reader": "cache.lookup", "case": case, "found": n,
                         "seconds": s, "bytes_read": b, "bytes": size, "write_seconds": round(write_s, 1)})
            print(rows[-1], file=sys.stderr, flush=True)
        shutil.rmtree(os.path.join(tmp, "sst"))
        con = duckdb.connect(config={"threads": 2})
        for rg in (int(x) for x in args.row_groups.split(",") if x):
            for bloom in (True,):
                path = os.path.join(tmp, f"cache-{rg}.parquet")
                t = time.perf_counter()
                write_parquet(path, args.entries, rg, bloom)
                write_s = time.perf_counter() - t
                size = os.path.getsize(path)
                for case, keys in (("backfill", hit), ("new day", miss)):
                    want = pa.array(keys)
                    n, s, b = timed_read(lambda path=path, want=want: ds.dataset(path).to_table(
                        filter=pc.field("key").isin(want)).num_rows)
                    rows.append({"format": f"Parquet, {rg:,}-row groups", "reader": "pyarrow.dataset", "case": case,
                                 "found": n, "seconds": s, "bytes_read": b, "bytes": size,
                                 "write_seconds": round(write_s, 1)})
                    print(rows[-1], file=sys.stderr, flush=True)
                    con.register("wanted", pa.table({"key": want}))
                    n, s, b = timed_read(lambda path=path: con.execute(
                        f"SELECT * FROM read_parquet('{path}') WHERE key IN (SELECT key FROM wanted)"
                    ).fetch_arrow_table().num_rows)
                    rows.append({"format": f"Parquet, {rg:,}-row groups", "reader": "DuckDB", "case": case,
                                 "found": n, "seconds": s, "bytes_read": b, "bytes": size,
                                 "write_seconds": round(write_s, 1)})
                    print(rows[-1], file=sys.stderr, flush=True)
                os.unlink(path)
    finally:
        if not args.root:
            shutil.rmtree(tmp, ignore_errors=True)
    res = {"synthesized": True, "config": vars(args), "rows": rows,
           "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
    print(f"\n{args.run_rows:,} keys against {args.entries:,} entries (~400-character outputs), local disk:\n")
    print("| format | reader | case | found | seconds | bytes read | share of the cache |")
    print("|---|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['format']} | {r['reader']} | {r['case']} | {r['found']:,} | {r['seconds']:.2f} "
              f"| {r['bytes_read'] / 2**20:,.1f} MiB | {r['bytes_read'] / r['bytes']:.1%} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
