"""EvalScope's metric names and how a config may spell them.

The config checks ``evaluate.metric`` against them; the evaluate stage reads its scores by them.
"""
from __future__ import annotations

import re
from collections.abc import Iterable

# EvalScope's general_qa score names (METRIC_SCORE_KEYS of evalscope.benchmarks.general_qa_vqa_metrics), spelled
# out so that a config is checked where EvalScope is not installed (the scheduler, the DAG parser); a unit test
# compares them with EvalScope's own.
METRICS = ("Rouge-1-R", "Rouge-1-P", "Rouge-1-F", "Rouge-2-R", "Rouge-2-P", "Rouge-2-F",
           "Rouge-L-R", "Rouge-L-P", "Rouge-L-F", "bleu-1", "bleu-2", "bleu-3", "bleu-4")


def metric_key(name: str) -> str:
    """A name without case, separators ('-', '_', spaces) or the report's ``mean_`` prefix."""
    return re.sub(r"[\s_-]+", "", name.strip().lower()).removeprefix("mean")


def canonical_metric(name: str, known: Iterable[str] = METRICS) -> str:
    """EvalScope's spelling of a metric given in any case and with any separators; ValueError, listing the
    known names, for anything else."""
    key = metric_key(name)
    for known_name in known:
        if metric_key(known_name) == key:
            return known_name
    raise ValueError(f"unknown metric {name!r}; EvalScope's general_qa reports {', '.join(known)}")
