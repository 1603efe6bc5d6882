"""evaluate.min_score cannot fail open: the metric name is checked (and spelled as EvalScope does) when the
config loads, and a gate whose metric is missing from the scores fails the stage instead of passing."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from batch_llm import api
from batch_llm.config import ConfigError
from batch_llm.config.metric_names import METRICS
from batch_llm.layout import RunLayout
from batch_llm.manifests import EvaluateManifest
from batch_llm.stages.evaluate import EvaluationBelowThreshold, MetricNotScored
from helpers import demo_config


@pytest.mark.parametrize("given,stored", [("rouge-l-f", "Rouge-L-F"), ("Rouge-L-F", "Rouge-L-F"),
                                          ("rouge_l_f", "Rouge-L-F"), ("ROUGE L F", "Rouge-L-F"),
                                          ("mean_Rouge-L-F", "Rouge-L-F"), ("BLEU_4", "bleu-4")])
def test_metric_spellings_are_stored_as_evalscope_spells_them(tmp_path, given, stored):
    assert demo_config(tmp_path, evaluate__metric=given).evaluate.metric == stored


def test_an_unknown_metric_is_a_config_error_listing_the_known_names(tmp_path):
    with pytest.raises(ConfigError) as ei:
        demo_config(tmp_path, evaluate__metric="rouge-x")
    msg = str(ei.value)
    assert "evaluate.metric" in msg and "'rouge-x'" in msg and "Rouge-L-F" in msg and "bleu-4" in msg, msg


def test_the_known_names_are_evalscopes():
    keys = pytest.importorskip("evalscope.benchmarks.general_qa_vqa_metrics").METRIC_SCORE_KEYS
    assert set(METRICS) == {n for names in keys.values() for n in names}


def _gate(tmp_path, manifest: EvaluateManifest, **overrides):
    cfg = demo_config(tmp_path, **overrides)
    layout = RunLayout.for_run(cfg, run_id="manual__gate", ds="2026-01-01")
    manifest.write(layout.stage("evaluate").path())  # a committed evaluation: the gate alone runs
    filtered = SimpleNamespace(generation=getattr(manifest, "filter_generation", None))  # the pass it scored
    return api.evaluate(cfg, layout, None, filtered)


def test_a_score_under_another_spelling_is_gated(tmp_path):
    m = EvaluateManifest(metrics={"Rouge-L-F": 0.05, "bleu-1": 0.5}, num_samples=4)
    with pytest.raises(EvaluationBelowThreshold, match="Rouge-L-F = 0.0500"):
        _gate(tmp_path, m, evaluate__metric="rouge_l_f", evaluate__min_score=0.1)
    assert _gate(tmp_path, m, evaluate__metric="bleu_1", evaluate__min_score=0.1) == m


def test_a_metric_missing_from_the_scores_fails_the_gate(tmp_path):
    m = EvaluateManifest(metrics={"bleu-1": 0.5, "bleu-2": 0.4}, num_samples=4)
    with pytest.raises(MetricNotScored, match=r"Rouge-L-F.*found: bleu-1, bleu-2"):
        _gate(tmp_path, m, evaluate__metric="Rouge-L-F", evaluate__min_score=0.1)
    assert _gate(tmp_path, m, evaluate__metric="Rouge-L-F") == m  # no min_score: no gate


def test_a_skipped_evaluation_is_not_gated(tmp_path):
    m = EvaluateManifest(skipped="no reference answers (column 'reference')")
    assert _gate(tmp_path, m, evaluate__min_score=0.1) == m
