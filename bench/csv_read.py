"""CSV input read: the reader the planner uses (``io.formats.read_file_rows``: Python's csv module, line counted)
against pyarrow's streaming CSV reader (``pyarrow.csv.open_csv`` with an ``invalid_row_handler``), over one file
of N rows (a quoted line break every 50th row, a blank line every 1000th), best of REPEATS passes each.

    python -m bench csv-read [--rows 1000000] [--repeats 3] [--out FILE]

pyarrow is timed doing the least a replacement must do: columns read as binary (a string column fails its whole
batch on one byte that is not UTF-8), each value decoded in Python (that byte is its row's error alone), one dict
per row; single-threaded (``invalid_row_handler`` gets no row number with ``use_threads``), and once threaded.
Neither pyarrow pass gives a row its line (the handler's ``number`` counts records, not lines; valid rows get
none): the line would still have to be rebuilt by counting line breaks in every value. ``--probe`` prints what
pyarrow reports for a small file with a quoted line break, a blank line and a record past ``block_size``.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import random
import tempfile
import time
from pathlib import Path


def make_csv(path: Path, rows: int) -> None:
    rnd = random.Random(1)
    words = 'the quick brown fox jumps over a lazy dog, and then: "quotes" appear'.split()
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["id", "prompt", "max_tokens"])
        for i in range(rows):
            text = " ".join(rnd.choices(words, k=rnd.randint(5, 40)))
            if i % 50 == 0:
                text += "\nsecond line"
            w.writerow([f"r{i}", text, str(rnd.randint(4, 64))])
            if i % 1000 == 999:
                f.write("\n")


def read_today(path: Path) -> int:
    from batch_llm.io.formats import Lines, read_file_rows
    from upath import UPath

    return sum(1 for _ in read_file_rows(UPath(str(path)), "csv", Lines(64 << 20)))


def read_pyarrow(path: Path, threads: bool) -> int:
    import pyarrow as pa
    import pyarrow.csv as pc

    names = pc.open_csv(path).schema.names
    bad: list = []

    def skip(row) -> str:
        bad.append(row)
        return "skip"

    reader = pc.open_csv(path, read_options=pc.ReadOptions(use_threads=threads, block_size=4 << 20),
                         parse_options=pc.ParseOptions(newlines_in_values=True,
                                                       invalid_row_handler=skip),
                         convert_options=pc.ConvertOptions(column_types=dict.fromkeys(names, pa.binary())))
    n = 0
    for batch in reader:
        for values in zip(*(c.to_pylist() for c in batch.columns)):
            dict(zip(names, [v.decode("utf-8", "surrogateescape") if v is not None else None for v in values]))
            n += 1
    return n + len(bad)


def probe() -> dict:
    import pyarrow as pa
    import pyarrow.csv as pc

    data = b'id,prompt\na,"two\nlines"\n\nb,x,extra\nc,ok\n'  # b is on line 5, c on line 6
    seen: list = []

    def skip(row) -> str:
        seen.append(row)
        return "skip"

    r = pc.open_csv(io.BytesIO(data), read_options=pc.ReadOptions(use_threads=False),
                    parse_options=pc.ParseOptions(newlines_in_values=True,
                                                  invalid_row_handler=skip))
    valid = [x for b in r for x in b.to_pylist()]
    out = {"file_lines": {"b": 5, "c": 6}, "handler_number_of_b": seen[0].number, "valid_rows": valid}
    big = b"id,prompt\na,x\nb," + b"y" * 3000 + b"\nc,z\n"
    try:
        r = pc.open_csv(io.BytesIO(big), read_options=pc.ReadOptions(block_size=1024))
        out["record_past_block_size"] = [x["id"] for b in r for x in b.to_pylist()]
    except pa.ArrowInvalid as e:
        out["record_past_block_size"] = f"the read fails: {e}"
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench csv-read", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--probe", action="store_true", help="print what pyarrow reports for a small file")
    p.add_argument("--out", default=None, help="append the result as a JSON line")
    a = p.parse_args(argv)
    if a.probe:
        print(json.dumps(probe(), indent=1, default=str))
        return 0
    with tempfile.TemporaryDirectory(prefix="csv_read_") as tmp:
        path = Path(tmp) / "in.csv"
        make_csv(path, a.rows)
        runs = {"today (csv module)": lambda: read_today(path),
                "pyarrow open_csv, one thread": lambda: read_pyarrow(path, False),
                "pyarrow open_csv, threads": lambda: read_pyarrow(path, True)}
        best: dict[str, float] = {}
        for _ in range(a.repeats):  # alternating, so a slower moment of the machine falls on each
            for name, fn in runs.items():
                t = time.perf_counter()
                n = fn()
                assert n == a.rows, (name, n)
                best[name] = min(best.get(name, float("inf")), time.perf_counter() - t)
        result = {"rows": a.rows, "bytes": path.stat().st_size,
                  "seconds": {k: round(v, 2) for k, v in best.items()},
                  "rows_per_s": {k: round(a.rows / v) for k, v in best.items()}}
    print(json.dumps(result, indent=1))
    if a.out:
        with open(a.out, "a") as f:
            f.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
