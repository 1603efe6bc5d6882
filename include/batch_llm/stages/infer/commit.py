"""A shard's commit: its finished rows written to storage as immutable chunks while it runs, then merged into the
shard's outputs and errors, with the manifest written last (``ShardCommit``).

A chunk (``<shard>/chunks/chunk-<seq>-<random>.jsonl``) is never changed once written: a retry reads the chunks,
skips every committed row id and generates only the rest; a row committed twice by an interrupted commit is the
same row, merged once (``shard_merge``). The checkpoints around each write are announced as audit events
(``checkpoint``)."""
from __future__ import annotations

import sys
import time
import uuid
from collections.abc import Iterable

from upath import UPath

from batch_llm.config import EngineConfig
from batch_llm.io.storage import Location, list_files, write_jsonl
from batch_llm.manifests import ShardManifest, ShardSpec
from batch_llm.stages.shard_merge import committed_ids, finish_shard

# The shard's checkpoints, announced as audit events: free when nobody listens; the resume tests listen
# (tests/fault_injection) and kill the worker there. No fault injection lives in this package.
CHECKPOINT_EVENT = "batch_llm.shard.checkpoint"


def checkpoint(point: str, where: str = "") -> None:
    """``where``: the shard's folder, so that a listener can pick one run's shards among a service's many."""
    sys.audit(CHECKPOINT_EVENT, point, where)


class ShardCommit:
    """The rows of one shard on their way to storage. ``add`` gathers finished rows (results, errors, cache hits);
    ``write_chunk`` writes them as one chunk once ``engine.commit_every_rows`` rows are gathered or
    ``engine.commit_every_seconds`` passed since the last (at once when forced); ``committed_ids`` names the rows
    earlier attempts committed, which the run skips; ``merge`` folds the chunks into the shard's outputs and errors
    and ``write_manifest`` writes the manifest, the shard's last file."""

    def __init__(self, engine: EngineConfig, shard_dir: Location):
        self.shard_dir = shard_dir
        self.chunks_dir = shard_dir.child("chunks")
        self.every_rows, self.every_seconds = engine.commit_every_rows, engine.commit_every_seconds
        self.pending: list[dict] = []
        self.seq = len(list_files(self.chunks_dir.path(), ".jsonl"))
        self.last = time.perf_counter()

    def committed_ids(self) -> set[str]:
        return committed_ids(self.chunks_dir)

    def add(self, rows: Iterable[dict]) -> None:
        self.pending.extend(rows)

    def write_chunk(self, force: bool = False) -> None:
        if not self.pending or not (force or len(self.pending) >= self.every_rows or
                                    time.perf_counter() - self.last >= self.every_seconds):
            return
        checkpoint("before_commit", self.shard_dir.url)
        # Sorted by input position: the final merge streams the chunks (heapq.merge) in input order.
        self.pending.sort(key=lambda r: r["idx"])
        write_jsonl(self.chunks_dir.child(f"chunk-{self.seq:05d}-{uuid.uuid4().hex[:8]}.jsonl").path(), self.pending)
        self.seq += 1
        self.pending = []
        self.last = time.perf_counter()
        checkpoint("after_commit", self.shard_dir.url)

    def merge(self, shard: ShardSpec, shard_path: UPath, n_rows: int) -> ShardManifest:
        """The committed chunks merged into the shard's outputs and errors, and the manifest that names them (its
        metrics from the rows; not written yet)."""
        manifest = finish_shard(shard.index, self.shard_dir, self.chunks_dir, shard_path, n_rows)
        manifest.plan_key = shard.plan_key
        return manifest

    def write_manifest(self, manifest: ShardManifest) -> None:
        checkpoint("before_manifest", self.shard_dir.url)
        manifest.write(self.shard_dir.path())
