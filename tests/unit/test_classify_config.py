"""engine.task classify: what the config refuses, the cache namespace it keys on, the published columns."""
from __future__ import annotations

import pytest
from batch_llm.config import ConfigError
from batch_llm.rows.records import output_record
from helpers import cache_namespace, demo_config

LABELS = ["positive", "negative", "neutral"]


def test_classify_loads_on_vllm_with_labels(tmp_path):
    cfg = demo_config(tmp_path, engine__task="classify", engine__classify={"labels": LABELS})
    assert cfg.engine.task == "classify" and cfg.engine.classify.labels == LABELS
    assert demo_config(tmp_path, engine__task="classify").engine.classify.labels is None  # the model's own head


@pytest.mark.parametrize("kind", ["transformers", "lmdeploy"])
def test_classify_refused_for_other_engines(tmp_path, kind):
    with pytest.raises(ConfigError, match=r"task: classify runs on vLLM's pooling runner.*engine.kind: vllm"):
        demo_config(tmp_path, engine__task="classify", engine__kind=kind)


@pytest.mark.parametrize("labels, said", [(["yes", "yes"], "labels must be distinct"),
                                          (["only"], "at least 2 items")])
def test_classify_labels_checked(tmp_path, labels, said):
    with pytest.raises(ConfigError, match=said):
        demo_config(tmp_path, engine__task="classify", engine__classify={"labels": labels})


def test_classify_settings_refused_without_classify(tmp_path):
    with pytest.raises(ConfigError, match=r"engine.classify: settings of engine.task: classify"):
        demo_config(tmp_path, engine__classify={"labels": LABELS})


@pytest.mark.parametrize("override, named", [({"sampling.n": 2}, "sampling.n"),
                                             ({"sampling.logprobs": 3}, "sampling.logprobs"),
                                             ({"input.sampling_columns": ["temperature"]},
                                              "input.sampling_columns: temperature")])
def test_classify_refuses_generation_settings(tmp_path, override, named):
    with pytest.raises(ConfigError, match=rf"{named}.*engine.task: classify generates no text"):
        demo_config(tmp_path, engine__task="classify", **{k.replace(".", "__"): v for k, v in override.items()})


def test_the_cache_keys_on_the_task_and_its_classes(tmp_path):
    generate = cache_namespace(tmp_path)
    embed = cache_namespace(tmp_path, engine__task="embed")
    classify = cache_namespace(tmp_path, engine__task="classify", engine__classify={"labels": LABELS})
    assert len({generate, embed, classify}) == 3
    assert cache_namespace(tmp_path, engine__task="classify", engine__classify={"labels": LABELS[:2]}) != classify
    assert cache_namespace(tmp_path, engine__task="classify", engine__classify={"labels": LABELS},
                      sampling__temperature=0.5) == classify  # the sampling decides no class


def test_published_row_has_the_top_class_and_one_score_column_per_class():
    result = {"id": "a", "output": None, "label": "negative", "scores": {"positive": 0.2, "negative": 0.7,
                                                                        "neutral": 0.1}}
    row = output_record({"id": "a", "review": "broke"}, result, "parquet")
    assert row["label"] == "negative" and "scores" not in row
    assert (row["score_positive"], row["score_negative"], row["score_neutral"]) == (0.2, 0.7, 0.1)
    # an input column named label (a gold label) keeps its value; the prediction is output_label
    row = output_record({"id": "a", "label": "positive", "score_neutral": "x"}, result, "csv")
    assert (row["label"], row["output_label"]) == ("positive", "negative")
    assert row["score_neutral"] == "x" and row["output_score_neutral"] == 0.1
    # an error row: no prediction, the gold label untouched
    row = output_record({"id": "a", "label": "positive"}, {"id": "a", "output": None, "error": "too long"}, "jsonl")
    assert row["label"] == "positive" and "output_label" not in row and row["error"] == "too long"


def test_classify_constructor_arguments_keep_the_users_hf_overrides(tmp_path):
    from batch_llm.engines.vllm_engine import VllmEngine

    cfg = demo_config(tmp_path, engine__task="classify", engine__classify={"labels": LABELS},
                      engine__extra={"hf_overrides": {"rope_theta": 20000.0}})
    args = VllmEngine(str(tmp_path), cfg.engine, cfg.sampling)._task_args()
    assert (args["runner"], args["convert"]) == ("pooling", "classify")
    assert args["hf_overrides"] == {"classifier_from_token": LABELS, "method": "no_post_processing",
                                    "rope_theta": 20000.0}
    plain = demo_config(tmp_path, engine__extra={"hf_overrides": {"rope_theta": 20000.0}})
    assert VllmEngine(str(tmp_path), plain.engine, plain.sampling)._task_args() == \
        {"hf_overrides": {"rope_theta": 20000.0}}

