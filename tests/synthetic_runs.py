"""A published-looking synthetic run (shard outputs, plan shards, error files, earlier partitions for the score
trend), written with the storage helpers the stages use: for the report, doctor and CLI tests."""
from __future__ import annotations

import random

from batch_llm.io.storage import Location, write_json, write_jsonl
from batch_llm.manifests import (
    EvaluateManifest,
    FetchManifest,
    FilterManifest,
    FilterSummary,
    PlanManifest,
    RunManifests,
    RunSummary,
    ShardManifest,
    ShardSpec,
)


def plan_manifest(*, rows_read: int = 0, valid: int = 0, invalid: int = 0, errors: str = "",
                  shards: list[ShardSpec] | None = None) -> PlanManifest:
    """A plan manifest with these counts (the fields the doctor and the report do not read: placeholders)."""
    return PlanManifest(input="in.jsonl", format="jsonl", rows_read=rows_read, valid=valid, invalid=invalid,
                        errors=errors, records="records.jsonl", shards=shards or [], has_references=True)


def filter_manifest(rows: int = 0, *, summary: FilterSummary | None = None) -> FilterManifest:
    return FilterManifest(outputs="outputs.jsonl", rows=rows, inference_errors="errors.jsonl", inference_error_rows=0,
                          summary=summary or FilterSummary(rows_scanned=rows))


def fetch_manifest(local_dir: str) -> FetchManifest:
    """The fetch manifest of a model folder (the doctor reads the folder's config.json)."""
    return FetchManifest(source="local", id="m", local_dir=local_dir, cache_hit=True, files=[], total_bytes=0,
                         content_hash="0" * 64, model_key="m")


def shard_manifest(index: int, metrics: dict, *, engine: dict | None = None, outputs: str = "", errors: str = "",
                   phases: list[dict] | None = None) -> ShardManifest:
    return ShardManifest(shard=index, outputs=outputs, errors=errors, metrics=metrics, checksum="", engine=engine,
                         phases=phases or [])


def run_summary(*, config: dict, plan: PlanManifest, infer: list[ShardManifest] | None = None,
                filter: FilterManifest | None = None, evaluate: EvaluateManifest | None = None,
                fetch: FetchManifest | None = None, pipeline: str = "synthetic", run_id: str = "r1",
                partition: str = "dt=2026-12-03", rows_published: int = 0) -> RunSummary:
    """A run summary as publish writes it (dataset, errors and report: placeholders)."""
    return RunSummary(pipeline=pipeline, run_id=run_id, partition=partition, rows_published=rows_published,
                      format="jsonl", dataset="data.jsonl", errors="errors.jsonl", config=config,
                      manifests=RunManifests(plan=plan, filter=filter or filter_manifest(rows_published),
                                             evaluate=evaluate or EvaluateManifest(), fetch=fetch, infer=infer),
                      published_at="2026-12-03T10:00:00+00:00")


def make_run(root, n_shards: int, rows_per_shard: int = 6, *, partition: str = "dt=2026-12-03",
             earlier: tuple[str, ...] = ("dt=2026-12-01", "dt=2026-12-02"),
             seed: int = 0) -> tuple[RunSummary, Location, Location]:
    """A published-looking run under ``root/pipe``: (summary, version Location, pipeline root Location)."""
    rng = random.Random(seed)
    pipe = Location(str(root / "pipe"))
    run = pipe.child("runs", partition, "r1")
    plan_shards, shards = [], []
    idx = 0
    for i in range(n_shards):
        rows, plan_rows = [], []
        for _ in range(rows_per_shard):
            p, c = rng.randint(20, 600), rng.randint(4, 256)
            rows.append({"id": f"q{idx}", "idx": idx, "output": "ok", "finish_reason": "length" if c == 256 else "stop",
                         "prompt_tokens": p, "completion_tokens": c, "cached": False, "error": None})
            plan_rows.append({"id": f"q{idx}", "idx": idx,
                              "messages": [{"role": "user", "content": f"question {idx}"}]})
            idx += 1
        sd = run.child("infer", f"shard-{i:05d}")
        write_jsonl(sd.child("outputs.jsonl").path(), rows)
        write_jsonl(sd.child("errors.jsonl").path(), [])
        pu = run.child("plan", f"shard-{i:05d}.jsonl")
        write_jsonl(pu.path(), plan_rows)
        plan_shards.append(ShardSpec(index=i, rows=rows_per_shard, url=pu.url))
        start, gen = 30 + rng.random() * 10, 200 + rng.random() * 100
        out_tok = sum(r["completion_tokens"] for r in rows)
        t = 1_780_000_000.0 + (i % 8) * 3.0  # 8 GPUs: shards start in waves
        phases = [{"name": "spawn", "start": t, "end": t + 1}, {"name": "imports", "start": t + 1, "end": t + 9},
                  {"name": "read", "start": t + 9, "end": t + 10},
                  {"name": "engine", "start": t + 10, "end": t + 10 + start},
                  {"name": "tokenize", "start": t + 10, "end": t + 14},
                  {"name": "first_token", "start": t + 10 + start, "end": t + 11 + start},
                  {"name": "generation", "start": t + 11 + start, "end": t + 10 + start + gen},
                  {"name": "merge", "start": t + 10 + start + gen, "end": t + 12 + start + gen},
                  {"name": "commit", "start": t + 12 + start + gen, "end": t + 13 + start + gen}]
        shards.append(shard_manifest(
            i, phases=phases, outputs=sd.child("outputs.jsonl").url, errors=sd.child("errors.jsonl").url,
            metrics={"rows": rows_per_shard, "ok": rows_per_shard, "errors": 0,
                        "input_tokens": sum(r["prompt_tokens"] for r in rows), "output_tokens": out_tok,
                        "output_tokens_this_attempt": out_tok, "chunks": 1, "engine_start_seconds": round(start, 2),
                        "generate_seconds": round(gen, 2), "cached_rows": 0, "seconds": round(start + gen + 5, 2),
                        "output_tokens_per_second": round(out_tok / gen, 1), "unique_prompts": rows_per_shard},
            engine={"kind": "vllm", "version": "0.32.0", "attempts": [{"ok": True}],
                    "settings": {"max_model_len": 4096, "max_num_seqs": 256, "gpu_memory_utilization": 0.9,
                                 "num_kv_blocks": 20000, "block_size": 16, "enable_prefix_caching": True,
                                 "kv_cache_dtype": "auto", "tensor_parallel_size": 1, "device": "cuda"}}))
    plan_errors = run.child("plan", "errors.jsonl")
    write_jsonl(plan_errors.path(),
                [{"source": "in.jsonl", "line": 3, "id": None, "reason": "missing id (column 'id')"}])
    valid = n_shards * rows_per_shard
    metrics = {"Rouge-L-F": 0.31, "Rouge-1-F": 0.35, "bleu-4": 0.15}
    summary = run_summary(
        partition=partition, rows_published=valid - 2,
        config={"name": "synthetic", "engine": {"kind": "vllm", "max_num_seqs": None, "batch_size": 16,
                                                    "gpu_memory_utilization": 0.9, "kv_cache_dtype": "auto"},
                   "sampling": {"max_tokens": 256, "temperature": 0.0, "seed": 0},
                   "sharding": {"rows_per_shard": rows_per_shard, "num_shards": None, "sort_by_length": True},
                   "evaluate": {"enabled": True, "metric": "Rouge-L-F", "min_score": 0.2},
                "filter": {"enabled": True}},
        plan=plan_manifest(rows_read=valid + 1, valid=valid, invalid=1, errors=plan_errors.url, shards=plan_shards),
        filter=filter_manifest(valid - 2, summary=FilterSummary(
            rows_scanned=valid, rows_affected=5, rows_dropped=2, rows_flagged=1, rows_masked=2,
            hits_per_list={"en": 4, "ours": 2}, hits_per_word={"en": {"darn": 3, "heck": 1}, "ours": {"secret": 2}},
            lists=[{"name": "en", "action": "mask"}, {"name": "zh", "action": "mask"},
                   {"name": "ours", "action": "drop"}])),
        evaluate=EvaluateManifest(metrics=metrics, num_samples=valid), infer=shards)
    for k, name in enumerate(earlier):  # earlier partitions, published the way publish writes them
        v = pipe.child(name, "v-1")
        run_summary(partition=name, run_id=f"old{k}", config={"name": "synthetic"}, plan=plan_manifest(),
                    evaluate=EvaluateManifest(metrics={m: s - 0.02 * (len(earlier) - k) for m, s in metrics.items()},
                                              num_samples=10)).write(v.path())
        write_json(pipe.child(name, "_CURRENT.json").path(), {"version": v.url})
    version = pipe.child(partition, "v-20261203T100000-r1")
    return summary, version, pipe
