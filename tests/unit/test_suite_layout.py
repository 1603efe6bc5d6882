"""The test tree itself: tests/ has no __init__.py, so pytest imports each module under its basename, and two
modules of one name fail collection ("import file mismatch") in whichever process collects both — which make
test's xdist workers do, in an order of their own, so a clash can pass locally and fail in CI."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_test_module_basenames_are_unique():
    by_name: dict[str, list[str]] = defaultdict(list)
    for path in TESTS.rglob("test_*.py"):
        by_name[path.name].append(str(path.relative_to(TESTS)))
    assert {n: p for n, p in by_name.items() if len(p) > 1} == {}
