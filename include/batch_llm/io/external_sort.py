"""The one external sort: more items than fit in memory sorted through local files (``ExternalSort``), and
sorted streams merged with a bounded number of them open at once (``merge_sorted``).

Its callers: the plan's shards sorted by length (``stages/plan.py``), a shard's committed chunks merged in input
order (``stages/shard_merge.py``) and a result-cache table's entries sorted by key (``cache/results.py``). Runs are
local files of pickled blocks of items (the items are the callers' own tuples and dicts, read back only by this
process); both are stable: equal items keep the order they were added in, or of their streams.
"""
from __future__ import annotations

import heapq
import os
import pickle
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial
from typing import Any, Generic, TypeVar

T = TypeVar("T")

RUN_ITEMS = 50_000       # items sorted in memory before a run is spilled to a local file...
RUN_BYTES = 64 * 2**20   # ...or fewer, once their sizes (as the caller counts them) come to this
FAN_IN = 64              # streams merged at once; more are merged in passes through local runs
_BLOCK = 4096            # items pickled together: one pickle call a block, not one an item


def write_run(path: str, items: Iterable[T]) -> None:
    """Writes items, in the order given, to a local run file."""
    block: list[T] = []
    with open(path, "wb") as fh:
        for item in items:
            block.append(item)
            if len(block) >= _BLOCK:
                pickle.dump(block, fh, protocol=pickle.HIGHEST_PROTOCOL)
                block = []
        if block:
            pickle.dump(block, fh, protocol=pickle.HIGHEST_PROTOCOL)


def read_run(path: str) -> Iterator[T]:
    """The items of a run file, in order; the file is opened at the first item asked for."""
    with open(path, "rb") as fh:
        while True:
            try:
                block = pickle.load(fh)
            except EOFError:
                return
            yield from block


def _merge(streams: list[Iterable[T]], key: Callable[[T], Any] | None) -> Iterator[T]:
    # The items are the callers' own: comparable by themselves, or by ``key``; typeshed cannot say so of a T.
    return heapq.merge(*streams, key=key)  # type: ignore[arg-type]


def merge_sorted(streams: Sequence[Callable[[], Iterable[T]]], tmp: str | os.PathLike, *,
                 key: Callable[[T], Any] | None = None, fan_in: int = FAN_IN) -> Iterator[T]:
    """One sorted stream of sorted streams (``heapq.merge``), equal items in the order of ``streams``. Each stream
    is an opener, called when its items are wanted; at most ``fan_in`` are open at once: more are merged
    ``fan_in`` at a time into local runs under ``tmp``, in passes, and the runs deleted at the end."""
    openers = list(streams)
    if len(openers) <= fan_in:
        yield from _merge([o() for o in openers], key)
        return
    work = tempfile.mkdtemp(prefix="merge-", dir=tmp)
    try:
        level = 0
        while len(openers) > fan_in:
            runs: list[Callable[[], Iterable[T]]] = []
            for i in range(0, len(openers), fan_in):
                path = os.path.join(work, f"{level}-{i:06d}")
                write_run(path, _merge([o() for o in openers[i:i + fan_in]], key))
                runs.append(partial(read_run, path))
            openers, level = runs, level + 1
        yield from _merge([o() for o in openers], key)
    finally:
        shutil.rmtree(work, ignore_errors=True)


class ExternalSort(Generic[T]):
    """Sorts more items than fit in memory, stably: runs of at most ``run_items`` items, or of ``run_bytes`` by
    the sizes given to ``add``, are sorted in memory and spilled to local files under ``tmp``; ``sorted_items``
    merges them as it is read and deletes them at its end. Without a spill nothing touches the disk."""

    def __init__(self, tmp: str | os.PathLike, *, key: Callable[[T], Any] | None = None, run_items: int = RUN_ITEMS,
                 run_bytes: int = RUN_BYTES, fan_in: int = FAN_IN):
        self.tmp, self.key, self.run_items, self.run_bytes, self.fan_in = tmp, key, run_items, run_bytes, fan_in
        self._buf: list[T] = []
        self._size = 0
        self._runs: list[str] = []
        self._dir: str | None = None

    def add(self, item: T, size: int = 0) -> None:
        self._buf.append(item)
        self._size += size
        if len(self._buf) >= self.run_items or self._size >= self.run_bytes:
            self._spill()

    def _spill(self) -> None:
        if self._dir is None:
            self._dir = tempfile.mkdtemp(prefix="sort-", dir=self.tmp)
        self._buf.sort(key=self.key)
        path = os.path.join(self._dir, f"run-{len(self._runs):06d}")
        write_run(path, self._buf)
        self._runs.append(path)
        self._buf, self._size = [], 0

    def sorted_items(self) -> Iterator[T]:
        """Every item added, sorted; read once."""
        if not self._runs:
            self._buf.sort(key=self.key)
            items, self._buf = self._buf, []
            yield from items
            return
        if self._buf:
            self._spill()
        try:
            yield from merge_sorted([partial(read_run, p) for p in self._runs], self._dir or self.tmp,
                                    key=self.key, fan_in=self.fan_in)
        finally:
            if self._dir is not None:
                shutil.rmtree(self._dir, ignore_errors=True)
