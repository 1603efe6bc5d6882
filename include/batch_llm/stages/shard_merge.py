"""The end of a shard: committed chunks merged into ``outputs.jsonl`` / ``errors.jsonl``, streamed.

Chunks are immutable files under ``<shard>/chunks/``, each sorted by input position; the merge is a k-way
merge (in passes of ``MERGE_FAN_IN`` files through local runs, so open files stay bounded) that keeps one
row per id, and both outputs are streamed atomic writes: a worker's memory does not grow with the shard.
"""
from __future__ import annotations

import hashlib
import json
import tempfile
from collections.abc import Iterator
from functools import partial

from batch_llm.io.external_sort import merge_sorted
from batch_llm.io.storage import Location, atomic_writer, iter_jsonl, json_bytes, list_files
from batch_llm.manifests import ShardManifest, ShardMetrics


def committed_ids(chunks_dir: Location) -> set[str]:
    """Ids of every row a chunk has committed (what a retry skips)."""
    return {r["id"] for f in list_files(chunks_dir.path(), ".jsonl") for r in iter_jsonl(f)}


# Chunks merged at once; more are merged in passes through local runs, so open files stay bounded.
MERGE_FAN_IN = 64


def _merged_rows(files: list, tmp_dir: str) -> Iterator[dict]:
    """Rows of idx-sorted JSONL files in one idx-sorted stream, each id once (a row committed twice by an
    interrupted commit is the same row). Holds one row per open file, not the shard."""
    last = None
    for r in merge_sorted([partial(iter_jsonl, f) for f in files], tmp_dir, key=_idx, fan_in=MERGE_FAN_IN):
        if r["id"] != last:
            yield r
        last = r["id"]


def _idx(row: dict) -> int:
    return row["idx"]


def finish_shard(index: int, shard_dir: Location, chunks_dir: Location, shard_path, n_rows: int) -> ShardManifest:
    """Merges committed chunks into outputs.jsonl / errors.jsonl: one row per id, in input order, streamed
    (a worker's memory does not grow with the shard). The manifest it returns has the row counts; the
    caller adds the attempt's timings, the engine and the phases."""
    chunk_files = list_files(chunks_dir.path(), ".jsonl")
    m = ShardMetrics(rows=n_rows, chunks=len(chunk_files))
    digest = hashlib.sha256(b"[")  # sha256 of the JSON list of ids in input order, built as rows pass
    with tempfile.TemporaryDirectory(prefix="batch_llm_merge_") as tmp, \
            atomic_writer(shard_dir.child("outputs.jsonl").path()) as ok, \
            atomic_writer(shard_dir.child("errors.jsonl").path()) as bad:
        for r in _merged_rows(chunk_files, tmp):
            digest.update(((", " if m.ok + m.errors else "") + json.dumps(r["id"])).encode())
            m.input_tokens += r["prompt_tokens"]
            m.cached_prompt_tokens += r.get("cached_prompt_tokens", 0)  # rows committed before it was recorded: 0
            line = json_bytes(r) + b"\n"
            m.thinking_unfinished += r.get("thinking_ended") is False
            if r["error"]:
                m.errors += 1
                if r.get("error_kind") == "invalid_output":  # generated, though not usable
                    m.invalid_outputs += 1
                    m.invalid_output_tokens += r["completion_tokens"]
                bad.write(line)
            else:
                m.ok += 1
                m.output_tokens += r["completion_tokens"]
                m.reasoning_tokens += r.get("reasoning_tokens", 0)
                ok.write(line)
        if m.ok + m.errors != n_rows:
            committed = committed_ids(chunks_dir)
            missing = [r["id"] for r in iter_jsonl(shard_path) if r["id"] not in committed]
            raise RuntimeError(f"shard {index}: {len(missing)} rows have no committed result "
                               f"(first: {missing[:3]}); the engine dropped requests")
    digest.update(b"]")
    return ShardManifest(shard=index, outputs=shard_dir.child("outputs.jsonl").url,
                         errors=shard_dir.child("errors.jsonl").url, metrics=m, checksum=digest.hexdigest()[:16])
