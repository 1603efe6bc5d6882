"""What earlier runs of a pipeline generated, by prompt prefix group: the planner's order where rows end before
their budget (EOS).

The plan puts the longest generations first, so they overlap the short ones instead of trailing on a near-empty
batch. It knows each row's budget (``max_tokens``), but a model that answers a yes/no template in 5 tokens and a
summary template in 300 under one budget of 512 makes the budget a poor guess. Each shard records, per prefix
group (the CRC-32 of the prompt's first 64 and 512 bytes, ``rows/prefix.py``: a template, a system prompt), how many
rows it generated and how many tokens; the next plan estimates a row's length from the deepest of its groups
with at least ``MIN_ROWS`` rows (the mean, at most its budget) and orders by that (``sharding.length_history``).
Only the order changes: outputs are the same rows, restored to input order.

Where: beside the result cache, ``<cache root>/lengths/<key>/`` (``store_for``), the key being the pipeline's
name and model. Each shard attempt writes one small JSON object (at most ``MAX_GROUPS`` groups, the most rows
first), named by its UTC time so a listing is oldest first; a plan reads the newest ``READ_FILES``; a writer
deletes all but the newest ``KEEP_FILES``, so the folder stays bounded whatever the history. It is a hint: an
unreadable object is skipped, a failed write said and left, two writers racing at most keep a few more."""
from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Iterable
from typing import TYPE_CHECKING

from batch_llm.io.storage import json_bytes, list_files, read_json, write_bytes_atomic

if TYPE_CHECKING:
    from batch_llm.config import PipelineConfig
    from batch_llm.io.storage import Location

log = logging.getLogger(__name__)

HISTORY_LEVELS = (64, 512)  # the prefix levels lengths are kept for: a template's head, then its body
MIN_ROWS = 4                # a group's mean is used once it has this many rows
MAX_GROUPS = 4096           # a shard's record keeps its groups with the most rows
READ_FILES = 32             # a plan reads the newest records (a day's shards, a few days)
KEEP_FILES = 256            # a writer deletes older ones

Group = tuple[int, int]  # (CRC-32 of the first 64 bytes, of the first 512), 0 where the prompt is shorter


def store_for(cache_root: "Location", cfg: "PipelineConfig") -> "Location":
    """Where the pipeline's length records are kept: one folder per pipeline and model."""
    from batch_llm.io.identity import stable_hash

    key = stable_hash({"pipeline": cfg.name, "model": cfg.model.model_dump(mode="json")})[:16]
    return cache_root.child("lengths", key)


class LengthRecorder:
    """A shard's generated rows counted per prefix group: rows and tokens."""

    def __init__(self) -> None:
        self.groups: dict[Group, list[int]] = {}

    def add(self, group: Group, tokens: int) -> None:
        if not group[0]:  # a prompt under 64 bytes has no group: nothing to learn for others
            return
        counts = self.groups.setdefault(group, [0, 0])
        counts[0] += 1
        counts[1] += tokens

    def write(self, store: "Location", keep: int = KEEP_FILES) -> str | None:
        """Writes the record as one new object under ``store`` and deletes all but the newest ``keep``; returns
        its name (None when nothing was generated)."""
        if not self.groups:
            return None
        top = sorted(self.groups.items(), key=lambda kv: -kv[1][0])[:MAX_GROUPS]
        now = time.time()  # to the microsecond: records of one second keep their order
        name = f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime(now))}.{int(now % 1 * 1e6):06d}-{uuid.uuid4().hex[:8]}.json"
        write_bytes_atomic(store.child(name).path(),
                           json_bytes({"levels": list(HISTORY_LEVELS), "groups": [[*g, n, t] for g, (n, t) in top]}))
        for old in list_files(store.path(), ".json")[:-keep]:
            try:
                old.unlink()
            except OSError:  # another writer deleted it first
                pass
        return name


class LengthHistory:
    """The newest records of a pipeline merged: a row's estimated output length from its groups."""

    def __init__(self, records: Iterable[dict], store: "Location", files: int = 0) -> None:
        self.deep: dict[Group, list[int]] = {}
        self.head: dict[int, list[int]] = {}
        self.store, self.files = store, files
        for record in records:
            if record.get("levels") != list(HISTORY_LEVELS):  # another layout: not comparable
                continue
            for g64, g512, n, tokens in record.get("groups") or ():
                for counts in (self.deep.setdefault((g64, g512), [0, 0]), self.head.setdefault(g64, [0, 0])):
                    counts[0] += n
                    counts[1] += tokens
        self.rows_estimated = 0  # rows whose estimate came from the history (below their budget or not)

    @classmethod
    def load(cls, store: "Location", read: int = READ_FILES) -> "LengthHistory | None":
        """The newest ``read`` records under ``store``; None where there are none (a first run)."""
        files = list_files(store.path(), ".json")[-read:]
        records = []
        for f in files:
            try:
                records.append(read_json(f))
            except (OSError, ValueError) as e:  # a hint: one unreadable record is skipped, said
                log.warning("length history: %s skipped (%s)", f, e)
        return cls(records, store, files=len(records)) if records else None

    @property
    def groups(self) -> int:
        return len(self.deep)

    def estimate(self, group: Group, budget: int) -> int:
        """The row's expected output tokens: the mean of its 512-byte group, else of its 64-byte group, where that
        has ``MIN_ROWS`` rows; at most ``budget``; the budget itself where neither does (or the prompt is too short
        to have a group)."""
        if not group[0]:
            return budget
        for counts in (self.deep.get(group), self.head.get(group[0])):
            if counts and counts[0] >= MIN_ROWS:
                self.rows_estimated += 1
                return min(budget, max(1, math.ceil(counts[1] / counts[0])))
        return budget

    def summary(self) -> dict:
        """For the plan manifest: where it was read, how many records and groups, how many rows it ordered."""
        return {"store": self.store.url, "files": self.files, "groups": self.groups,
                "rows_estimated": self.rows_estimated}
