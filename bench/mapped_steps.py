"""The plan in parts, the filter per shard and the publish from parts against one task each, 10M-100M tiny rows
in 100 files.

Each step runs in a fresh process of its own (``python bench/mapped_steps.py step NAME DIR [SHARD]``), as an
Airflow task would, so its time and peak RSS are its own. The day: ``--files`` JSONL files of tiny prompt rows
(~45 bytes). The shards' outputs are **synthesized** as the echo
engine of the tests writes them (``echo <prompt tokens>``, in input order, 1 % of them with a listed word), so no
engine runs and what is measured is the pipeline's own work. Then the day both ways:

- **one task**: ``api.plan_shards`` in one process, ``api.content_filter`` over every shard in one process (the
  filter before it was mapped), and publish writing every row;
- **mapped** (``output.parts``, ``sharding.plan_part_bytes`` one file a part): the plan's steps (list the parts,
  scan each part, the join of their ids a hash-bucket group a task, place, write each part's shards,
  gather), ``api.filter_shard`` per shard, each
  in its own process (the ``filter_shard`` tasks, each writing its shard's published file), ``api.join_filter``
  (the ``content_filter`` task, which reads no row), and publish linking the parts into the version.

Reported per step: the largest single task's seconds and peak RSS, and the task-seconds summed over its tasks.

    .venv/bin/python -m bench mapped-steps --sizes 10000000 --out bench/results/mapped-steps.json

``--parallel N`` runs a mapped step's tasks N at a time, as N worker slots would (each task's seconds then
include the others' load); the task-seconds are what the workers share.

Needs about 0.6 KB of disk per row (input, plan spool, shards, outputs, parts, dataset), freed after each size;
the mapped day frees its input and the parts' spools once planned (no later step reads them).
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

ROOT = Path(__file__).resolve().parents[1]


def make_input(folder: Path, rows: int, files: int) -> int:
    """``files`` JSONL files of tiny prompt rows; one row in 10,000 repeats the id of a row of the file before
    (a duplicate the plan reports, found across files)."""
    folder.mkdir(parents=True, exist_ok=True)
    per, extra = divmod(rows, files)
    n = 0
    for f in range(files):
        with open(folder / f"part-{f:05d}.jsonl", "w", encoding="utf-8") as fh:
            for _ in range(per + (f < extra)):
                rid = n - per - 1 if f and n % 10_000 == 9_999 else n
                fh.write(f'{{"id": "r{rid:010d}", "prompt": "say {n % 997}"}}\n')
                n += 1
    return sum(p.stat().st_size for p in folder.iterdir())


def synthesize_outputs(layout, plan) -> list:
    """What the shard runner with the tests' echo engine writes: one output a row in input order, no errors."""
    from batch_llm.io.storage import Location, atomic_writer, iter_jsonl, json_bytes
    from batch_llm.manifests import ShardMetrics, ShardResult

    shards = []
    for s in plan.shards:
        d = layout.shard_dir(s.index)
        rows = sorted((r["idx"], r["id"]) for r in iter_jsonl(Location(s.url).path()))  # one shard: bounded
        with atomic_writer(d.child("outputs.jsonl").path()) as w:
            for idx, rid in rows:
                text = f"echo {idx % 7}" + (" my password" if idx % 100 == 0 else "")  # 1 % hit a listed word
                w.write(json_bytes({"id": rid, "idx": idx, "output": text, "finish_reason": "stop",
                                    "prompt_tokens": 5, "completion_tokens": 2, "error": None,
                                    "synthesized": True}) + b"\n")
        with atomic_writer(d.child("errors.jsonl").path()):
            pass
        shards.append(ShardResult(shard=s.index, outputs=d.child("outputs.jsonl").url, plan_key=s.plan_key,
                                  errors=d.child("errors.jsonl").url, metrics=ShardMetrics(rows=len(rows), ok=len(rows))))
    return shards


def _plan_step(name: str, cfg, layout, part: int | None) -> dict:
    """One step of the plan in parts (``part``: the part, or the join's group, of a mapped one)."""
    from batch_llm import api

    n = part if part is not None else -1  # the mapped steps are given one
    if name == "plan_parts":
        return {"parts": len(api.plan_parts(cfg, layout).parts)}
    if name == "plan_scan":
        return {"rows": api.plan_scan_part(cfg, layout, n).rows_read}
    if name == "plan_join":
        return {"dups": (api.plan_join_group(cfg, layout, n).part_starts or [0])[-1]}
    if name == "plan_place":
        return {"dups": sum(p.duplicates for p in api.plan_place(cfg, layout).places)}
    if name == "plan_write":
        return {"shards": len(api.plan_write_part(cfg, layout, n).shards)}
    plan = api.plan_gather(cfg, layout)
    return {"valid": plan.valid, "shards": len(plan.shards)}


def run_step(name: str, workdir: Path, shard: int | None) -> dict:
    """One step in this (fresh) process."""
    from batch_llm import api
    from batch_llm.config import parse_config
    from batch_llm.io.storage import peak_rss_mb
    from batch_llm.layout import RunLayout, read_manifest_at

    cfg = parse_config(json.loads((workdir / "config.json").read_text()), "bench")
    layout = RunLayout.for_run(cfg, run_id="mapped", ds="2026-12-06")
    t0 = time.perf_counter()
    extra: dict = {}
    shards = lambda: json.loads((workdir / "shards.json").read_text())  # noqa: E731
    if name == "plan":
        plan = api.plan_shards(cfg, layout)
        extra = {"valid": plan.valid, "shards": len(plan.shards)}
    elif name.startswith("plan_"):
        extra = _plan_step(name, cfg, layout, shard)
    elif name == "synthesize":
        results = synthesize_outputs(layout, read_manifest_at(layout, "plan"))
        (workdir / "shards.json").write_text(json.dumps([s.model_dump(mode="json") for s in results]))
    elif name == "filter_one_task":
        m = api.content_filter(cfg, layout, read_manifest_at(layout, "plan"), shards())
        extra = {"rows": m.rows, "dropped": m.summary.rows_dropped}
    elif name == "filter_shard":
        p = api.filter_shard(cfg, layout, read_manifest_at(layout, "plan"), shards()[shard])
        (workdir / "parts").mkdir(exist_ok=True)
        (workdir / "parts" / f"{shard}.json").write_text(p.model_dump_json())
        extra = {"rows": p.rows}
    elif name == "join":
        parts = [json.loads(p.read_text()) for p in sorted((workdir / "parts").iterdir())]
        m = api.join_filter(cfg, layout, read_manifest_at(layout, "plan"), shards(), parts)
        extra = {"rows": m.rows, "dropped": m.summary.rows_dropped}
    elif name == "publish":
        published = api.publish(cfg, layout, read_manifest_at(layout, "plan"), read_manifest_at(layout, "filter"),
                                api.evaluate(cfg, layout, read_manifest_at(layout, "plan"),
                                             read_manifest_at(layout, "filter")))
        extra = {"rows": published.rows}
    else:
        raise SystemExit(f"unknown step {name}")
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return {"step": name, "seconds": round(time.perf_counter() - t0, 2),
            "cpu_seconds": round(ru.ru_utime + ru.ru_stime, 2), "peak_rss_mb": peak_rss_mb(), **extra}


def _step(name: str, workdir: Path, shard: int | None = None) -> dict:
    """A step in a fresh process; its seconds are the process's whole life (imports included), as a task's."""
    env = {**os.environ, "TMPDIR": str(workdir / "tmp")}
    (workdir / "tmp").mkdir(exist_ok=True)
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, __file__, "step", name, str(workdir), *([str(shard)] if shard is not None else [])],
                       capture_output=True, text=True, env=env)
    if p.returncode:
        raise RuntimeError(f"step {name} failed:\n{p.stderr[-3000:]}")
    r = json.loads(p.stdout.strip().splitlines()[-1])
    r["task_seconds"] = round(time.perf_counter() - t0, 2)
    return r


def _tasks(runs: list[dict]) -> dict:
    """A step of one or more tasks: its largest task (seconds, peak RSS) and its task-seconds."""
    return {"tasks": len(runs), "largest_task_seconds": max(r["task_seconds"] for r in runs),
            "largest_task_rss_mb": max(r["peak_rss_mb"] for r in runs),
            "task_seconds": round(sum(r["task_seconds"] for r in runs), 1),
            **{k: sum(r[k] for r in runs) for k in ("rows", "dropped", "valid", "parts", "shards", "dups")
               if k in runs[0]}}


def _mapped(name: str, workdir: Path, n: int, parallel: int) -> list[dict]:
    """A mapped step's ``n`` tasks, ``parallel`` at a time (as that many workers' slots would run them)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(parallel) as pool:
        return list(pool.map(lambda i: _step(name, workdir, i), range(n)))


def _variant(rows: int, files: int, rows_per_shard: int, work: Path, mapped: bool, parallel: int = 1) -> dict:
    """One day through the steps: today's single tasks (``mapped`` False), or filter_shard × N with
    ``output.parts`` and the join, then publish from the parts."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    size = make_input(work / "in", rows, files)
    cfg = {"name": "mapped", "model": {"ref": "unused"}, "input": {"path": str(work / "in"), "format": "jsonl"},
           "output": {"path": str(work / "out"), "parts": mapped},
           # mapped: the plan too, one part a file
           "sharding": {"rows_per_shard": rows_per_shard,
                        **({"plan_part_bytes": max(f.stat().st_size for f in (work / "in").iterdir())}
                           if mapped else {})},
           "evaluate": {"enabled": False}, "cache": {"enabled": False},
           "filter": {"lists": [{"name": "secrets", "path": "builtin:en", "action": "drop"}]}}
    (work / "config.json").write_text(json.dumps(cfg))
    res: dict = {"input_bytes": size}

    def step(name: str, runs: list[dict]) -> None:
        res[name] = _tasks(runs)
        print(f"  {rows:>11,} {'mapped' if mapped else 'one task':<9} {name:<16} {res[name]}", flush=True)

    if mapped:  # the plan's five steps, the scans and writes one task a part
        n_parts = _tasks([_step("plan_parts", work)])["parts"]
        step("plan_parts", [_step("plan_parts", work)])
        step("plan_scan", _mapped("plan_scan", work, n_parts, parallel))
        step("plan_join", _mapped("plan_join", work, n_parts, parallel))
        step("plan_place", [_step("plan_place", work)])
        step("plan_write", _mapped("plan_write", work, n_parts, parallel))
        step("plan_gather", [_step("plan_gather", work)])
        # No later step reads the input or the parts' spools and id hashes: freed, so 100M rows fit the disk
        shutil.rmtree(work / "in")
        for f in (work / "out").glob("*/runs/*/*/plan/parts/part-*/*"):
            if f.name in ("spool.tsv", "entries.bin"):
                f.unlink()
    else:
        step("plan", [_step("plan", work)])
    _step("synthesize", work)
    n_shards = len(json.loads((work / "shards.json").read_text()))
    if mapped:
        step("filter_shard", _mapped("filter_shard", work, n_shards, parallel))
        step("join", [_step("join", work)])
    else:
        step("filter_one_task", [_step("filter_one_task", work)])
    step("publish", [_step("publish", work)])
    shutil.rmtree(work, ignore_errors=True)
    return res


def bench_size(rows: int, files: int, rows_per_shard: int, base: Path, variants: tuple[str, ...],
               parallel: int = 1) -> dict:
    res: dict = {"rows": rows, "files": files, "rows_per_shard": rows_per_shard, "parallel": parallel}
    for v in variants:
        res[v] = _variant(rows, files, rows_per_shard, base / f"rows-{rows}-{v}", mapped=v == "mapped",
                          parallel=parallel)
    return res


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["step"]:
        print(json.dumps(run_step(argv[1], Path(argv[2]), int(argv[3]) if len(argv) > 3 else None)))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="10000000,100000000")
    ap.add_argument("--files", type=int, default=100)
    ap.add_argument("--rows-per-shard", type=int, default=100_000)
    ap.add_argument("--variants", default="one_task,mapped", help="one_task, mapped or both (comma-separated)")
    ap.add_argument("--parallel", type=int, default=1, help="a mapped step's tasks run this many at a time")
    ap.add_argument("--dir", default=None, help="work folder (default: a temporary one)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "mapped-steps.json"))
    a = ap.parse_args(argv)
    base = Path(a.dir or tempfile.mkdtemp(prefix="batch_llm_mapped_"))
    results = []
    for n in (int(x) for x in a.sizes.split(",")):
        results.append(bench_size(n, a.files, a.rows_per_shard, base, tuple(a.variants.split(",")), a.parallel))
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"machine": os.uname().nodename, "cpus": os.cpu_count(),
                                           "results": results}, indent=1))
    print("\n| rows | variant | step | tasks | largest task s | largest task MB | task-seconds |")
    print("| ---: | --- | --- | ---: | ---: | ---: | ---: |")
    for r in results:
        for variant in (v for v in ("one_task", "mapped") if v in r):
            for step, t in r[variant].items():
                if isinstance(t, dict):
                    print(f"| {r['rows']:,} | {variant} | {step} | {t['tasks']} | {t['largest_task_seconds']} | "
                          f"{t['largest_task_rss_mb']:.0f} | {t['task_seconds']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
