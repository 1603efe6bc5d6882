"""The one external sort (``batch_llm.io.external_sort``): what it returns equals a stable in-memory sort however
the items are spilled and merged, at most ``fan_in`` streams are open at once, and its local runs are gone at the
end. The plan's shard sort, the shard's final merge and the result cache's tables all go through it."""
from __future__ import annotations

import random

import pytest
from batch_llm.io.external_sort import ExternalSort, merge_sorted


@pytest.mark.parametrize(("run_items", "fan_in"), [(10_000, 64), (7, 64), (7, 3), (1, 2)])
def test_sorted_items_equal_a_stable_in_memory_sort(tmp_path, run_items, fan_in):
    rng = random.Random(run_items * 31 + fan_in)
    items = [(rng.randrange(20), i) for i in range(500)]  # many equal keys: stability shows
    sorter: ExternalSort[tuple[int, int]] = ExternalSort(tmp_path, key=lambda x: x[0], run_items=run_items,
                                                         fan_in=fan_in)
    for item in items:
        sorter.add(item)
    assert list(sorter.sorted_items()) == sorted(items, key=lambda x: x[0])
    assert list(tmp_path.iterdir()) == []  # every run deleted once read


def test_runs_spill_by_the_bytes_the_caller_counts(tmp_path):
    sorter: ExternalSort[int] = ExternalSort(tmp_path, run_items=10**6, run_bytes=100)
    for i in range(50, 0, -1):
        sorter.add(i, size=10)  # a run every 10 items
    assert len(sorter._runs) == 5
    assert list(sorter.sorted_items()) == list(range(1, 51))


def test_merge_keeps_at_most_fan_in_streams_open_and_equal_items_in_stream_order(tmp_path):
    open_now, most = 0, 0

    def stream(n: int):
        def items():
            nonlocal open_now, most
            open_now += 1
            most = max(most, open_now)
            try:
                yield from ((k, n) for k in range(0, 30, 3))
            finally:
                open_now -= 1
        return items

    got = list(merge_sorted([stream(n) for n in range(10)], tmp_path, key=lambda x: x[0], fan_in=3))
    assert got == [(k, n) for k in range(0, 30, 3) for n in range(10)]
    assert most == 3 and list(tmp_path.iterdir()) == []
