"""Scale benchmark: plan, content filter, evaluate and publish at 100k, 1M and 10M rows (seconds, peak RSS).

Each stage runs in a fresh process of its own (``python bench/scale.py stage NAME DIR``), so its peak RSS is
its own and not the benchmark's. The input is synthesized chat rows of ~280 bytes (ids, a user message, a
reference answer). The engine's speed is measured elsewhere (``python -m bench inference``): here the shards'
outputs are **synthesized** (a ~200-character answer per row, written in input order as the shard runner
writes them), so the stages around the engine are measured alone. The result cache: ``python -m bench scale-cache``.

    .venv/bin/python -m bench scale --sizes 100000,1000000,10000000 --out bench/results/scale.json

Needs about 3 KB of disk per row at the largest size (input, plan spool, shards, outputs, dataset), freed
after each size.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches and "
         "customers review shipping speed price quality battery screen packaging support refund color").split()


def _text(rng: random.Random, chars: int) -> str:
    out, n = [], 0
    while n < chars:
        w = rng.choice(WORDS)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)


def make_input(path: Path, rows: int, seed: int = 0) -> int:
    """Synthesized chat rows, ~280 bytes each; prompt lengths vary (the planner sorts by them)."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(rows):
            row = {"id": f"r{i:09d}",
                   "messages": [{"role": "user", "content": "Summarize: " + _text(rng, rng.randint(120, 200))}],
                   "reference": _text(rng, 40)}
            f.write(json.dumps(row) + "\n")
    return path.stat().st_size


def synthesize_outputs(cfg, layout, plan) -> list:
    """What the shard runner would have written (outputs in input order, no errors), labelled synthesized."""
    from batch_llm.io.storage import Location, iter_jsonl, write_jsonl
    from batch_llm.manifests import ShardMetrics, ShardResult

    rng = random.Random(1)
    shards = []
    for s in plan.shards:
        d = layout.shard_dir(s.index)
        rows = sorted((r["idx"], r["id"]) for r in iter_jsonl(Location(s.url).path()))  # one shard: bounded
        n = write_jsonl(d.child("outputs.jsonl").path(), (
            {"id": rid, "idx": idx, "output": _text(rng, 200) + (" my password" if idx % 100 == 0 else ""),  # 1 % hits
             "finish_reason": "stop", "prompt_tokens": 60,
             "completion_tokens": 48, "cached": False, "error": None, "synthesized": True} for idx, rid in rows))
        write_jsonl(d.child("errors.jsonl").path(), [])
        shards.append(ShardResult(shard=s.index, outputs=d.child("outputs.jsonl").url,
                                  errors=d.child("errors.jsonl").url, metrics=ShardMetrics(rows=n, ok=n)))
    return shards


def run_stage(name: str, workdir: Path) -> dict:
    """One stage in this (fresh) process; prints {seconds, peak_rss_mb, ...}."""
    from batch_llm import api
    from batch_llm.config import parse_config
    from batch_llm.io.storage import peak_rss_mb
    from batch_llm.layout import RunLayout, read_manifest_at

    cfg = parse_config(json.loads((workdir / "config.json").read_text()), "bench")
    layout = RunLayout.for_run(cfg, run_id="scale", ds="2026-12-01")
    t0 = time.perf_counter()
    extra: dict = {}
    if name == "plan":
        plan = api.plan_shards(cfg, layout)
        extra = {"valid": plan.valid, "shards": len(plan.shards)}
    elif name == "synthesize":
        shards = synthesize_outputs(cfg, layout, read_manifest_at(layout, "plan"))
        (workdir / "shards.json").write_text(json.dumps([s.model_dump(mode="json") for s in shards]))
    elif name == "filter":
        results = json.loads((workdir / "shards.json").read_text())
        filtered = api.content_filter(cfg, layout, read_manifest_at(layout, "plan"), results)
        extra = {"rows": filtered.rows, "affected": filtered.summary.rows_affected}
    elif name == "evaluate":
        scored = api.evaluate(cfg, layout, read_manifest_at(layout, "plan"), read_manifest_at(layout, "filter"))
        extra = {"num_samples": scored.num_samples, "rows_with_references": scored.rows_with_references}
    elif name == "publish":
        published = api.publish(cfg, layout, read_manifest_at(layout, "plan"), read_manifest_at(layout, "filter"),
                                read_manifest_at(layout, "evaluate"),
                                extra_manifests={"infer": json.loads((workdir / "shards.json").read_text())})
        extra = {"rows": published.rows, "dataset_bytes": os.path.getsize(published.dataset.removeprefix("file://"))}
    else:
        raise SystemExit(f"unknown stage {name}")
    ru = resource.getrusage(resource.RUSAGE_SELF)
    # CPU seconds beside wall seconds: on a shared 2-core machine wall time also counts waiting for a core.
    return {"stage": name, "seconds": round(time.perf_counter() - t0, 2), "cpu_seconds": round(ru.ru_utime + ru.ru_stime, 2),
            "peak_rss_mb": peak_rss_mb(), **extra}


def _stage_in_process(name: str, workdir: Path) -> dict:
    env = {**os.environ, "TMPDIR": str(workdir / "tmp")}
    (workdir / "tmp").mkdir(exist_ok=True)
    p = subprocess.run([sys.executable, __file__, "stage", name, str(workdir)], capture_output=True, text=True, env=env)
    if p.returncode:
        raise RuntimeError(f"stage {name} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def bench_size(rows: int, base: Path, fmt: str, evaluate: bool) -> dict:
    work = base / f"rows-{rows}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    t0 = time.perf_counter()
    size = make_input(work / "input.jsonl", rows)
    made = time.perf_counter() - t0
    cfg = {"name": "scale", "model": {"ref": "unused"}, "input": {"path": str(work / "input.jsonl"), "format": "jsonl"},
           "output": {"path": str(work / "out")}, "sharding": {"rows_per_shard": 100_000},
           "evaluate": {"enabled": evaluate}, "cache": {"enabled": False}}
    (work / "config.json").write_text(json.dumps(cfg))
    res: dict = {"rows": rows, "input_bytes": size, "input_seconds": round(made, 1)}
    for name in ("plan", "synthesize", "filter", "evaluate", "publish"):
        r = _stage_in_process(name, work)
        res[name] = r
        print(f"  {rows:>10,} {name:<10} {r['seconds']:>8.1f} s  {r['peak_rss_mb']:>7.0f} MB  "
              f"{ {k: v for k, v in r.items() if k not in ('stage', 'seconds', 'peak_rss_mb')} }", flush=True)
    shutil.rmtree(work, ignore_errors=True)
    return res


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["stage"]:
        print(json.dumps(run_stage(argv[1], Path(argv[2]))))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="100000,1000000,10000000")
    ap.add_argument("--dir", default=None, help="work folder (default: a temporary one)")
    ap.add_argument("--format", default="jsonl")
    ap.add_argument("--no-evaluate", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "scale.json"))
    a = ap.parse_args(argv)
    base = Path(a.dir or tempfile.mkdtemp(prefix="batch_llm_scale_"))
    results = []
    for n in (int(x) for x in a.sizes.split(",")):
        results.append(bench_size(n, base, a.format, not a.no_evaluate))
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"machine": os.uname().nodename, "cpus": os.cpu_count(),
                                           "results": results}, indent=1))
    print("\n| rows | stage | seconds | CPU seconds | peak RSS MB |\n| ---: | --- | ---: | ---: | ---: |")
    for r in results:
        for name in ("plan", "filter", "evaluate", "publish"):
            print(f"| {r['rows']:,} | {name} | {r[name]['seconds']} | {r[name].get('cpu_seconds')} | "
                  f"{r[name]['peak_rss_mb']:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
