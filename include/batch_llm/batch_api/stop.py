"""A batch stopped before it is done (cancelled, or past its completion window), as OpenAI stops one: the requests
already answered are published, the rest are error lines (``batch_cancelled`` / ``batch_expired``).

A shard's task asks ``stop_reason`` before its engine starts and every few seconds while it runs; when it gets
one, it ends its worker (the GPU lease freed) and ``close_stopped_shard`` commits the shard with the chunks it
committed and an error row for every other row. The rest of the run (content filter, publish) goes on, so the
finished part is published like any run's."""
from __future__ import annotations

import time
import uuid
from typing import NamedTuple

from batch_llm.batch_api.store import BatchStore
from batch_llm.config.openai_batch import window_seconds
from batch_llm.io.storage import Location, iter_jsonl, write_jsonl
from batch_llm.layout import RunLayout
from batch_llm.manifests import ShardManifest, ShardSpec
from batch_llm.stages.infer.results import error_row
from batch_llm.stages.shard_merge import committed_ids, finish_shard

MESSAGES = {"batch_cancelled": "The batch was cancelled before this request ran.",
            "batch_expired": "This request could not be executed before the completion window expired."}
STATUS_OF = {"batch_cancelled": "cancelled", "batch_expired": "expired"}


class StopReason(NamedTuple):
    code: str       # batch_cancelled | batch_expired
    at: int         # when: the cancel's time, or the batch's expires_at


def expires_at(record: dict) -> int:
    return int(record["created_at"]) + window_seconds(record["completion_window"])


def stop_reason(store: BatchStore, batch_id: str, now: float | None = None) -> StopReason | None:
    """Why the batch's shards must stop now, recorded once in ``stopped.json`` (the first reason is the batch's);
    None while it may go on."""
    if (noted := store.note(batch_id, "stopped")) is not None:
        return StopReason(noted["code"], noted["at"])
    record = store.batch(batch_id)
    now = time.time() if now is None else now
    reason = None
    if (cancel := store.note(batch_id, "cancel")) is not None:
        reason = StopReason("batch_cancelled", int(cancel["cancelling_at"]))
    elif now >= expires_at(record):
        reason = StopReason("batch_expired", expires_at(record))
    if reason is None:
        return None
    noted = store.write_note(batch_id, "stopped", {"code": reason.code, "at": reason.at}, once=True)
    return StopReason(noted["code"], noted["at"])


def close_stopped_shard(layout: RunLayout, shard: ShardSpec | dict, code: str) -> ShardManifest:
    """Commits the shard as stopped: its committed chunks, and for each row without one an error row with
    ``error_code`` ``code`` (publish writes it as that OpenAI error). A shard already committed stays as it is."""
    spec = shard if isinstance(shard, ShardSpec) else ShardSpec.model_validate(shard)
    shard_dir = layout.shard_dir(spec.index)
    if (done := ShardManifest.read_if_done(shard_dir.path())) is not None:
        return done
    chunks = shard_dir.child("chunks")
    done_ids = committed_ids(chunks)
    shard_path = Location(spec.url, shard_dir.options).path()
    message = MESSAGES[code]
    rest = ({**error_row((r["id"], r["idx"]), message), "error_code": code}
            for r in iter_jsonl(shard_path) if r["id"] not in done_ids)
    # one chunk of the unanswered rows, idx-sorted as every chunk (the shard file is in input order)
    write_jsonl(chunks.child(f"chunk-99999-stopped-{uuid.uuid4().hex[:8]}.jsonl").path(), rest)
    manifest = finish_shard(spec.index, shard_dir, chunks, shard_path, spec.rows)
    manifest.plan_key = spec.plan_key
    manifest.write(shard_dir.path())
    return manifest
