"""sharding.shards_per_task: a day of many shards on one device, one cold start per shard against one per task.

The demo pipeline (its engine, vLLM on this CPU unless --engine) over a larger input (the demo's valid prompts
repeated under new ids), planned into --shards shards; then for each k of --per-task, a fresh run of the same
plan whose inference tasks run one after another as the GPU operator runs each (``IsolatedShard``: a spawned
worker per task, one engine per worker), then the filter and publish. The result cache is off (a second run
would otherwise be served from the first's cache). Per k: the tasks' wall time, the cold start the manifests
record (``spawn`` + ``imports`` + ``engine`` phases, and ``engine_start_seconds`` alone) summed over the day and
as a share of the inference time, and whether the published rows equal the first k's.

    python -m bench shards-per-task --shards 8 --per-task 1,8 --rows 160 --out bench/results/spt.jsonl
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from bench.runners import ROOT, cpu_env, emit

DEMO = ROOT / "dags" / "pipelines" / "demo.yaml"
DEMO_INPUT = ROOT / "include" / "sample_data" / "demo_prompts.jsonl"


def _input(path: Path, rows: int) -> None:
    valid = []
    for line in DEMO_INPUT.read_text(encoding="utf-8").splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if isinstance(r.get("id"), str) and (r.get("prompt") or (r.get("messages") or [{}])[0].get("role") == "user"):
            valid.append({k: r[k] for k in ("prompt", "messages") if k in r})
    seen = {json.dumps(v, sort_keys=True): v for v in valid}
    base = list(seen.values())
    with open(path, "w", encoding="utf-8") as f:
        for i in range(rows):
            row = dict(base[i % len(base)])  # a distinct prompt per row: no folding of identical prompts
            if "prompt" in row:
                row["prompt"] = f"{row['prompt']} (#{i})"
            else:
                row["messages"] = [{**row["messages"][0], "content": f"{row['messages'][0]['content']} (#{i})"}]
            f.write(json.dumps({"id": f"b{i:05d}", **row}) + "\n")


def _phases(m) -> dict[str, float]:
    out: dict[str, float] = {}
    for p in m.phases:
        out[p.name] = out.get(p.name, 0.0) + p.end - p.start
    return out


def run(a: argparse.Namespace) -> list[dict]:
    import os

    os.environ.update(cpu_env())
    from batch_llm import api
    from batch_llm.config import load_config
    from batch_llm.io.storage import Location, iter_jsonl
    from batch_llm.isolation.shard_process import IsolatedShard
    from batch_llm.layout import RunLayout, shard_manifests

    tmp = Path(a.workdir or tempfile.mkdtemp(prefix="bench_spt_"))
    tmp.mkdir(parents=True, exist_ok=True)
    src = tmp / "input.jsonl"
    _input(src, a.rows)
    records, first_rows = [], None
    for k in a.per_task:
        cfg = load_config(DEMO).with_overrides({
            "input.path": str(src), "output.path": str(tmp / "out"), "engine.kind": a.engine,
            "sharding.num_shards": a.shards, "sharding.shards_per_task": k, "sampling.max_tokens": a.max_tokens,
            "cache.enabled": False, "evaluate.enabled": False})
        layout = RunLayout.for_run(cfg, run_id=f"k{k}-{int(time.time())}", ds="2026-11-07")
        model = api.fetch(cfg, layout)
        plan = api.plan_shards(cfg, layout)
        tasks = api.shard_tasks(cfg, plan)
        task_walls, results = [], []
        for t in tasks:
            t0 = time.perf_counter()
            ms = IsolatedShard(cfg, layout, model.ref(), [s.model_dump() for s in t] if k > 1 else t[0].model_dump(),
                               holder="bench").run_all(on_line=lambda line: None)
            task_walls.append(time.perf_counter() - t0)
            results += [m.result() for m in ms]
            print(f"k={k}: task of shards {[s.index for s in t]} in {task_walls[-1]:.1f}s", flush=True)
        filtered = api.content_filter(cfg, layout, plan, results)
        published = api.publish(cfg, layout, plan, filtered, api.evaluate(cfg, layout, plan, filtered),
                                   extra_manifests={"infer": shard_manifests(layout)})
        rows = [(r["id"], r["output"]) for r in iter_jsonl(Location(published.dataset).path())]
        first_rows = first_rows if first_rows is not None else rows
        manifests = shard_manifests(layout)
        phases = [_phases(m) for m in manifests]
        cold = sum(p.get("spawn", 0) + p.get("imports", 0) + p.get("engine", 0) for p in phases)
        start = sum(m.metrics.engine_start_seconds for m in manifests)
        wall = sum(task_walls)
        rec = {"engine": a.engine, "shards": len(plan.shards), "rows": plan.valid, "max_tokens": a.max_tokens,
               "shards_per_task": k, "tasks": len(tasks), "engine_starts": sum(m.metrics.engine_start_seconds > 0
                                                                               for m in manifests),
               "inference_wall_s": round(wall, 1), "task_wall_s": [round(w, 1) for w in task_walls],
               "engine_start_s_sum": round(start, 1), "engine_start_share": round(start / wall, 3),
               "cold_start_s_sum": round(cold, 1), "cold_start_share": round(cold / wall, 3),
               "generate_s_sum": round(sum(m.metrics.generate_seconds for m in manifests), 1),
               "published_rows": len(rows), "same_rows_as_first": rows == first_rows}
        records.append(rec)
        emit(a.out, "shards-per-task", rec)
    return records


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench shards-per-task", description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", default="vllm")
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--per-task", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    p.add_argument("--rows", type=int, default=160)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--workdir", default=None)
    p.add_argument("--out", default=None, help="append each result as a JSON line here")
    a = p.parse_args(argv)
    recs = run(a)
    for r in recs:
        print(f"shards_per_task {r['shards_per_task']}: {r['tasks']} task(s), {r['engine_starts']} engine start(s), "
              f"inference {r['inference_wall_s']}s, engine start {r['engine_start_s_sum']}s "
              f"({r['engine_start_share']:.0%}), cold start {r['cold_start_s_sum']}s ({r['cold_start_share']:.0%})")
    return 0 if all(r["same_rows_as_first"] for r in recs) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
