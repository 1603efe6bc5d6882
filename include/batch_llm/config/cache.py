"""The ``cache`` section: where the result cache lives, how long its entries count, and when it is compacted."""
from __future__ import annotations

from pydantic import Field

from batch_llm.config.section import Section


class CacheConfig(Section):
    """The result cache: earlier outputs reused by content key (the table format: ``cache/table.py``; lookup and
    writing: ``cache/lookup.py``, ``cache/results.py``)."""

    enabled: bool = True
    path: str | None = Field(None, description="default: <output.path>/_cache")
    max_age_days: float | None = Field(90.0, gt=0, description="Entries older than this are misses and are "
                                       "dropped at compaction; null keeps them forever")
    compact_after_tables: int = Field(64, ge=2, description="Compact a namespace once it holds this many "
                                      "shard tables (the publish task does it)")
    max_runs: int = Field(8, ge=1, description="Compacted runs kept before they are merged into one")
