"""Plan shards: read the run's input, validate every row, split the valid rows into shards.

Invalid rows go to ``errors.jsonl`` with a reason (line, id when known) and the rest goes on. Shards are
contiguous ranges of the input (so outputs merge back in input order), sorted by prompt length inside
(similar lengths batch together: less padding for static batching, steadier decode batches for vLLM).
"""
from __future__ import annotations

import math

from batch_llm.config import PipelineConfig, ShardingConfig
from batch_llm.formats import PromptRow, detect_format, input_files, read_rows, to_prompt_row
from batch_llm.storage import Location, write_jsonl, write_manifest

def default_rows_per_shard(s: ShardingConfig, max_tokens: int) -> int:
    """Rows per shard that keep engine start under ``max_engine_start_share`` of the shard's time:

        start / (start + rows * max_tokens / tok_s) <= share  <=>  rows >= start * tok_s * (1 - share) / (share * max_tokens)

    e.g. 70 s start, 15k tok/s, 256 tokens, 10 % → 36,915 rows (docs/benchmarks.md, "Engine start")."""
    share = s.max_engine_start_share
    rows = s.expected_engine_start_seconds * s.expected_output_tokens_per_second * (1 - share) / (share * max_tokens)
    return max(256, math.ceil(rows))


def shard_sizes(n: int, s: ShardingConfig, max_tokens: int = 256) -> list[int]:
    if n == 0:
        return []
    if s.num_shards:
        k = min(s.num_shards, n)
    else:
        k = math.ceil(n / (s.rows_per_shard or default_rows_per_shard(s, max_tokens)))
    base, extra = divmod(n, k)
    return [base + (1 if i < extra else 0) for i in range(k)]


def _prompt_chars(r: PromptRow) -> int:
    return len(r.prompt_token_ids) * 4 if r.prompt_token_ids else sum(len(m["content"]) for m in r.messages)


def _shard_row(r: PromptRow) -> dict:
    row = {"id": r.id, "idx": r.idx, "messages": r.messages}
    if r.prompt_token_ids:
        row["prompt_token_ids"] = r.prompt_token_ids
    if r.max_tokens:
        row["max_tokens"] = r.max_tokens
    return row


def plan_shards(cfg: PipelineConfig, *, input_loc: Location, plan_dir: Location) -> dict:
    """Validates the input and writes shards; returns the plan manifest (shards listed for mapping)."""
    in_path = input_loc.path()
    first = input_files(in_path)[0]
    fmt = detect_format(first, cfg.input.format)
    if fmt == "jsonl" and cfg.input.format == "auto":
        fmt = _sniff_openai_batch(first) or fmt
    valid: list[PromptRow] = []
    records: list[dict] = []
    errors: list[dict] = []
    seen: dict[str, int] = {}
    n_read = 0
    for raw in read_rows(in_path, "openai_batch" if fmt == "openai_batch" else cfg.input.format):
        n_read += 1
        where = {"source": raw.source, "line": raw.line}
        if raw.error:
            errors.append({**where, "id": None, "reason": raw.error})
            continue
        try:
            row = to_prompt_row(raw, len(valid), cfg.input, fmt)
        except ValueError as e:
            rid = (raw.record or {}).get("custom_id" if fmt == "openai_batch" else cfg.input.id_column)
            errors.append({**where, "id": rid if isinstance(rid, (str, int)) else None, "reason": str(e)})
            continue
        if row.id in seen:
            errors.append({**where, "id": row.id, "reason": f"duplicate id {row.id!r} (first at line {seen[row.id]})"})
            continue
        seen[row.id] = raw.line
        valid.append(row)
        records.append({"idx": row.idx, "id": row.id, "reference": row.reference, "record": raw.record})

    shards = []
    start = 0
    for i, size in enumerate(shard_sizes(len(valid), cfg.sharding, cfg.sampling.max_tokens)):
        part = valid[start:start + size]
        start += size
        if cfg.sharding.sort_by_length:
            part = sorted(part, key=_prompt_chars)
        loc = plan_dir.child(f"shard-{i:05d}.jsonl")
        write_jsonl(loc.path(), (_shard_row(r) for r in part))
        shards.append({"index": i, "rows": size, "url": loc.url})
    write_jsonl(plan_dir.child("records.jsonl").path(), records)
    write_jsonl(plan_dir.child("errors.jsonl").path(), errors)
    manifest = {
        "stage": "plan", "input": input_loc.url, "format": fmt, "rows_read": n_read, "valid": len(valid),
        "invalid": len(errors), "errors": plan_dir.child("errors.jsonl").url,
        "records": plan_dir.child("records.jsonl").url, "shards": shards,
        "has_references": any(r["reference"] for r in records),
    }
    write_manifest(plan_dir.path(), manifest)
    return manifest


def _sniff_openai_batch(path) -> str | None:
    """A .jsonl file whose first object has custom_id and body is OpenAI Batch API input."""
    import json

    with path.open("rb") as fh:
        for line in fh:
            if line.strip():
                try:
                    obj = json.loads(line)
                except ValueError:
                    return None
                return "openai_batch" if isinstance(obj, dict) and "custom_id" in obj and "body" in obj else None
    return None
