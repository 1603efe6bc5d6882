"""The rows of a filter pass, read part after part by evaluate and publish.

A pass (``content_filter``) is one part a shard, in shard order, which is input order; a pass made before the
filter ran per shard is one file of each kind."""
from __future__ import annotations

from collections.abc import Iterator

from batch_llm.io.storage import Location, iter_jsonl
from batch_llm.manifests import FilterManifest


def _parts_or_whole(m: FilterManifest, key: str) -> list[str]:
    """The files of a filter pass holding ``key`` (outputs, inference_errors, dropped), in input order."""
    if m.parts:
        return [u for p in m.parts if (u := getattr(p, key)) is not None]
    whole = m.summary.dropped if key == "dropped" else getattr(m, key)
    return [whole] if whole else []


def filtered_outputs(m: FilterManifest, opts: dict) -> Iterator[dict]:
    """The rows a filter pass kept, in input order (shards are contiguous ranges of the input, in index order),
    streamed one part after the other."""
    for url in _parts_or_whole(m, "outputs"):
        yield from iter_jsonl(Location(url, opts).path())


def inference_errors(m: FilterManifest, opts: dict) -> Iterator[dict]:
    """The rows inference gave up on, with their reasons, in input order."""
    for url in _parts_or_whole(m, "inference_errors"):
        yield from iter_jsonl(Location(url, opts).path())


def dropped_rows(m: FilterManifest, opts: dict) -> Iterator[dict]:
    """The rows the word lists or the review dropped (id, idx, hits or reason), in input order."""
    for url in _parts_or_whole(m, "dropped"):
        yield from iter_jsonl(Location(url, opts).path())
