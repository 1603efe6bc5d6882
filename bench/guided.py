"""What guided decoding costs: the review-extraction pipeline with and without ``sampling.guided_decoding``.

Each run is a fresh ``batch-llm run`` process on the same input (the Chinese review sample repeated to
``--rows`` rows, prompt folding off so every row is generated), modes alternating, ``--repeats`` each. Two
clocks per run: the whole process (start to outputs published) and the shard's generation time; tokens
generated are counted from the shard manifest. Guided and unguided answers differ in length (guidance stops
at the end of the JSON object, an unguided small model often runs to max_tokens), so the comparable figure is
generated tokens per second of generation; the valid-output count says what each mode delivers.

    .venv/bin/python -m bench guided --rows 96 --repeats 3 --out bench/results/guided_cpu.jsonl
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from bench.runners import RESULTS, ROOT, alternating, append_jsonl, run, spread_text

YAML = ROOT / "dags" / "pipelines" / "review_extraction.yaml"
SAMPLE = ROOT / "include" / "sample_data" / "reviews_zh.jsonl"


def _input(tmp: Path, rows: int) -> Path:
    base = [json.loads(x) for x in SAMPLE.read_text(encoding="utf-8").splitlines()]
    path = tmp / "reviews.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for i in range(rows):
            f.write(json.dumps({**base[i % len(base)], "id": f"r{i:05d}"}, ensure_ascii=False) + "\n")
    return path


def run_once(mode: str, src: Path, tmp: Path, max_tokens: int) -> dict:
    out = tmp / f"out-{mode}-{time.monotonic_ns()}"
    args = [sys.executable, "-m", "batch_llm", "run", str(YAML), "--input", str(src), "--output", str(out),
            "--ds", "2026-11-10", "--plain", "--set", "cache.enabled=false", "--set", "engine.dedupe_prompts=false",
            "--set", f"sampling.max_tokens={max_tokens}", "--set", f"sampling.guided_decoding={mode == 'guided'}"]
    proc = run(args, merge_stderr=False)
    if proc.rc != 0:
        raise SystemExit(f"{mode} run failed:\n{proc.out[-3000:]}\n{proc.err[-3000:]}")
    (manifest,) = out.glob("review_extraction/runs/*/*/infer/shard-*/manifest.json")
    m = json.loads(manifest.read_text())["metrics"]
    return {"mode": mode, "process_seconds": round(proc.wall_s, 2), "generate_seconds": m["generate_seconds"],
            "engine_start_seconds": m["engine_start_seconds"], "rows": m["rows"],
            "valid": m["rows"] - m["errors"], "invalid_outputs": m["invalid_outputs"],
            "tokens_generated": m["output_tokens"],
            "gen_tokens_per_second": round(m["output_tokens"] / m["generate_seconds"], 1)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--out", default=str(RESULTS / "guided_cpu.jsonl"))
    a = ap.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_guided_") as t:
        tmp = Path(t)
        src = _input(tmp, a.rows)
        for rep, mode in alternating(("guided", "unguided"), a.repeats):
            r = run_once(mode, src, tmp, a.max_tokens)
            r["repeat"] = rep
            print(json.dumps(r), flush=True)
            results.append(r)
    append_jsonl(a.out, *({**r, "rows_in": a.rows, "max_tokens": a.max_tokens} for r in results))
    for mode in ("guided", "unguided"):
        rs = [r for r in results if r["mode"] == mode]
        figures = {k: spread_text([r[k] for r in rs], 2) for k in
                   ("process_seconds", "generate_seconds", "gen_tokens_per_second", "tokens_generated")}
        print(f"{mode:9s} process s {figures['process_seconds']}; generation s {figures['generate_seconds']}; "
              f"generated tok/s {figures['gen_tokens_per_second']}; tokens {figures['tokens_generated']}; "
              f"valid {[r['valid'] for r in rs]} of {rs[0]['rows']}")
    g = [r for r in results if r["mode"] == "guided"]
    u = [r for r in results if r["mode"] == "unguided"]
    ratios = [x["gen_tokens_per_second"] / y["gen_tokens_per_second"] for x, y in zip(g, u)]
    print(f"guided / unguided generated tok/s, per repeat: {[round(x, 3) for x in ratios]}")

