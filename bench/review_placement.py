"""Where the content review by a model (``filter.review``) runs: its own task after the shards, or the generating
worker swapping engines after its shard. The same rows, the same review, one clock, alternating.

    python -m bench review-placement --model GEN --review-model GUARD [--dummy --tokenizer TOK] --n 512 \
        --modes task,swap --repeats 3 --out FILE

Modes, each a fresh process (so the GPU memory is free between them):
  task  what the DAG runs today: the shard's worker (``python -m batch_llm.isolation.worker_child``: imports, engine
        start, generation, commit, fast end), then the review's own worker over that shard's outputs (the review
        task: ``stages.review.prepare_review`` writes the review requests, a second worker with the review model's
        engine, ``stage: review``, commits under ``<run>/review/``), one after the other
  swap  one worker does both: the shard as the worker runs it, its engine closed (no fast end: the process goes on),
        the review requests written, the review model's engine started in the same process and the review pass
        committed: what a review "in the generating worker" would cost. Imports are paid once; the first engine's
        orderly shutdown is paid instead of a kill
Both run the stage library's own calls (``api.infer_shard``, ``prepare_review``, ``review_pipeline_config``),
committed into a run folder of each run's own. The Airflow parts of a task (scheduling, the GPU lease wait of a
second mapped task) are not in either: what is compared is the worker's side, process start to the review's
manifest on disk.

The clock: ``wall_s`` process start → exit; ``outputs_s`` process start → the review shard's manifest written;
``gen_engine_start_s`` / ``review_engine_start_s`` each engine's start (imports excluded, from the manifests);
``second_start_s`` (task) the review worker's spawn → its engine ready, imports included; ``between_s`` the
generation shard's manifest → the review worker's first line (task) or the review engine's start (swap):
the cost of the hand-over.

The generation rows are the chat dataset of ``bench inference`` (review-extraction chats, long-tailed output
limits, ignore_eos); the review is the default generate-style prompt under the verdict's JSON schema
(``filter.review`` defaults: 64 tokens, guided), its engine the generation engine's settings (random weights too
with --dummy).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from bench.runners import (
    alternating,
    append_jsonl,
    bench_command,
    bench_config,
    child_env,
    print_result,
    run,
    spread,
)

MODES = ("task", "swap")


def _since_start() -> float:
    return time.time() - float(os.environ.get("BENCH_T0", time.time()))


def pipeline(a, work: Path):
    """The pipeline: the chat rows written, one shard, filter.review on with the review model."""
    import numpy as np
    from batch_llm.io.storage import Location, write_jsonl

    from bench.inference import chat_rows

    rows = chat_rows(a.n, a.out_len, np.random.default_rng(0))
    write_jsonl(Location(str(work / "input.jsonl")).path(), rows)
    engine = {"kind": "vllm", "max_model_len": a.max_model_len, "gpu_memory_utilization": a.gpu_util,
              "dtype": a.dtype, "enforce_eager": a.enforce_eager, "commit_every_rows": 256}
    extra = {"load_format": "dummy"} if a.dummy else {}
    review = {"model": {"ref": a.review_model}, "engine": {**engine, "extra": dict(extra)}}
    return bench_config(a.model, max_tokens=a.out_len, engine={**engine, "extra": dict(extra)},
                        input=str(work / "input.jsonl"), output=str(work),
                        sharding={"num_shards": 1}, filter={"enabled": True, "lists": [], "review": review})


def _planned(a):
    from batch_llm.io.storage import Location
    from batch_llm.layout import RunLayout
    from batch_llm.stages.plan import write_plan

    work = Path(tempfile.mkdtemp(prefix="bench_review_"))
    cfg = pipeline(a, work)
    layout = RunLayout.for_run(cfg, run_id="bench", ds="2026-01-01")
    plan = write_plan(cfg, input_loc=Location(cfg.input.path), plan_dir=Location(str(work / "plan")))
    model = {"local_dir": a.model, "model_key": "bench"}
    review_model = {"local_dir": a.review_model, "model_key": "bench-review"}
    return cfg, layout, plan, model, review_model


def _phase_end(m: dict, name: str) -> float | None:
    return next((p["end"] for p in m.get("phases") or [] if p["name"] == name and p.get("end")), None)


def run_task(a) -> dict:
    """Two workers, as the DAG's shard task and review task run them."""
    from batch_llm.isolation.shard_process import worker_spec
    from batch_llm.isolation.worker_parent import WorkerHandle
    from batch_llm.stages.review import prepare_review, review_pipeline_config

    cfg, layout, plan, model, review_model = _planned(a)
    gen = WorkerHandle.start(worker_spec(cfg, layout, model, plan.shards[0])).wait(on_line=_echo)
    gen_done = _phase_end(gen, "commit")
    spec = prepare_review(cfg, layout, plan, gen)
    first: list[float] = []
    ready: list[float] = []

    def on_line(line: str) -> None:
        if not first:
            first.append(time.time())
        if " started in " in line and "engine " in line and not ready:
            ready.append(time.time())
        _echo(line)

    spawned = time.time()
    rev = WorkerHandle.start(worker_spec(review_pipeline_config(cfg), layout, review_model, spec,
                                         stage="review")).wait(on_line=on_line)
    return _result("task", gen, rev, between=(first[0] - gen_done) if first and gen_done else None,
                   second_start=(ready[0] - spawned) if ready else None)


def run_swap(a) -> dict:
    """One worker: the shard, its engine closed, then the review's engine and pass in the same process (what
    ``python -m batch_llm.isolation.worker_child`` would do with both specs)."""
    from batch_llm.api import infer_shard
    from batch_llm.stages.review import prepare_review, review_pipeline_config

    cfg, layout, plan, model, review_model = _planned(a)
    clock = {"spawned_at": float(os.environ["BENCH_T0"]), "worker_started_at": float(os.environ["BENCH_T0"])}
    gen = infer_shard(cfg, layout, model, plan.shards[0], say=_echo, started=clock).model_dump(mode="json")
    closed = time.time()  # infer_shard closes its engine on the way out
    spec = prepare_review(cfg, layout, plan, gen)
    rev = infer_shard(review_pipeline_config(cfg), layout, review_model, spec, say=_echo, started=clock,
                      stage="review").model_dump(mode="json")
    gen_done = _phase_end(gen, "commit")
    return _result("swap", gen, rev, between=None if gen_done is None else closed - gen_done, second_start=None)


def _echo(line: str) -> None:
    if any(k in line for k in ("done", "Error", "started in", "review")):
        print("  [stage]", line[:300], flush=True)


def _result(mode: str, gen: dict, rev: dict, *, between: float | None, second_start: float | None) -> dict:
    g, r = gen["metrics"], rev["metrics"]
    end = _phase_end(rev, "commit")
    return dict(mode=mode, rows=g["rows"], reviewed=r["rows"], gen_generate_s=g["generate_seconds"],
                review_generate_s=r["generate_seconds"], gen_engine_start_s=g["engine_start_seconds"],
                review_engine_start_s=r["engine_start_seconds"], generated_tokens=g["output_tokens_this_attempt"],
                review_tokens=r["output_tokens_this_attempt"], review_ok=r.get("ok"),
                between_s=None if between is None else round(between, 2),
                second_start_s=None if second_start is None else round(second_start, 2),
                outputs_s=None if end is None else end - float(os.environ["BENCH_T0"]))


def child(a) -> None:
    res = (run_task if a.child == "task" else run_swap)(a)
    print_result(res)
    sys.stdout.flush()
    os._exit(0)  # the swap's review engine is left to the process's end, as a worker's fast end does


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--review-model", help="the review (guard) model's folder; default: --model")
    p.add_argument("--dummy", action="store_true", help="random weights (load_format dummy) for both models")
    p.add_argument("--tokenizer", help="with --dummy: a tokenizer folder put beside each model's config.json")
    p.add_argument("--n", type=int, default=512)
    p.add_argument("--out-len", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--gpu-util", type=float, default=0.90)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=900, help="seconds per run")
    p.add_argument("--out", help="append each run and the summary as JSON lines")
    p.add_argument("--child", help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else argv
    a = p.parse_args(argv)
    a.review_model = a.review_model or a.model
    if any(m not in MODES for m in a.modes.split(",")):
        p.error(f"--modes: {', '.join(MODES)}")
    if a.child:
        return child(a)
    if a.dummy and a.tokenizer:  # random weights, a tokenizer for the chat template and the review's text
        from bench.inference import chat_model_dir

        for attr in ("model", "review_model"):
            setattr(a, attr, chat_model_dir(argparse.Namespace(dummy=True, model=getattr(a, attr),
                                                                tokenizer=a.tokenizer)))
        argv = [*argv, "--model", a.model, "--review-model", a.review_model]
    runs: dict[str, list[dict]] = {}
    schedule = [m for _, m in alternating(a.modes.split(","), a.repeats)]
    for mode in schedule:
        proc = run(bench_command("review-placement", *argv, "--child", mode), env=child_env(), timeout=a.timeout)
        res = proc.result()
        if res is None:
            print(f"{mode} FAILED rc={proc.rc}\n{proc.out[-3000:]}", flush=True)
            continue
        res.update(wall_s=round(proc.wall_s, 2))
        runs.setdefault(mode, []).append(res)
        print(f"{mode}: {json.dumps(res)}", flush=True)
        append_jsonl(a.out, {"run": res})
    summary: dict = {"n": a.n, "out_len": a.out_len, "model": a.model, "review_model": a.review_model,
                     "dummy": a.dummy, "order": schedule}
    for mode, rs in runs.items():
        summary[mode] = {k: spread([r[k] for r in rs if r.get(k) is not None])
                         for k in ("wall_s", "outputs_s", "gen_engine_start_s", "review_engine_start_s",
                                   "between_s", "second_start_s", "gen_generate_s", "review_generate_s")
                         if any(r.get(k) is not None for r in rs)}
    if "task" in runs and "swap" in runs:
        summary["task_minus_swap_s"] = {k: round(summary["task"][k]["median"] - summary["swap"][k]["median"], 2)
                                        for k in ("wall_s", "outputs_s") if k in summary["task"] and k in
                                        summary["swap"]}
    print_result(summary, "SUMMARY ")
    append_jsonl(a.out, {"summary": summary})


if __name__ == "__main__":
    main()
