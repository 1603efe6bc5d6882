"""A shard's timeline: its phases as wall-clock intervals, recorded once and read by the report and the doctor.

Phases (``PHASES``), in the order a shard meets them::

    spawn       the operator starts the worker process → the worker's interpreter runs
    imports     the worker imports the stage library → the shard begins
    read        committed rows, the keys pass over the shard file, the cache lookup and its hits
    engine      engine start (in a thread of its own, overlapping the next phase)
    tokenize    chat template + tokenizer over the rows to send, while the engine starts (spooled)
    first_token generation begins → the first result (generation too: the engine works from its first step,
                but a row is a result only when its output is done, later when the largest output budgets
                lead the shard, as the planner orders it)
    generation  the first result → the last
    merge       committed chunks merged into outputs.jsonl / errors.jsonl
    commit      the cache table and the manifest

Times are seconds since the epoch (the worker and the operator are different processes), rounded to ms.
"""
from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batch_llm.manifests import Phase

PHASES = ("spawn", "imports", "read", "engine", "tokenize", "first_token", "generation", "merge", "commit")
# Generation (first_token and generation) is the work itself; the other phases are overhead a shard could
# shorten or hide.
AVOIDABLE = ("spawn", "imports", "read", "engine", "tokenize", "merge", "commit")


@dataclass
class Timeline:
    phases: list[dict] = field(default_factory=list)   # {"name", "start", "end"}
    _open: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, start: float, end: float | None = None) -> None:
        self.phases.append({"name": name, "start": round(start, 3), "end": round(end or time.time(), 3)})

    def begin(self, name: str) -> None:
        self._open[name] = time.time()

    def end(self, name: str) -> None:
        if name in self._open:
            self.add(name, self._open.pop(name))

    def to_list(self) -> list[dict]:
        return sorted(self.phases, key=lambda p: (p["start"], PHASES.index(p["name"]) if p["name"] in PHASES else 99))


def phase_seconds(phases: list[Phase]) -> dict[str, float]:
    """Seconds per phase name (a phase recorded twice, e.g. by a resumed attempt, adds up)."""
    out: dict[str, float] = {}
    for p in phases or []:
        out[p.name] = out.get(p.name, 0.0) + max(0.0, p.end - p.start)
    return out


def largest_avoidable(shard_phases: Iterable[list[Phase]]) -> tuple[str, float, float] | None:
    """(phase, seconds over all shards, share of the shards' wall time) of the largest overhead phase, from each
    shard's recorded phases."""
    totals: dict[str, float] = {}
    wall = 0.0
    for phases in shard_phases:
        if not phases:
            continue
        wall += max(p.end for p in phases) - min(p.start for p in phases)
        for name, sec in phase_seconds(phases).items():
            if name in AVOIDABLE:
                totals[name] = totals.get(name, 0.0) + sec
    if not totals or wall <= 0:
        return None
    name = max(totals, key=totals.__getitem__)
    return name, totals[name], totals[name] / wall
