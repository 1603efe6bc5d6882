"""``quantize.check_settings``: the early check of the export settings against the model's layer sizes."""
from __future__ import annotations

import json

import pytest
from batch_llm.config import QuantizeConfig
from batch_llm.stages import quantize as q


@pytest.fixture
def model_dir(tmp_path):
    """SmolLM2-135M's layer sizes: hidden 576, intermediate 1536 (groups of 32, 64 or 192 divide them)."""
    (tmp_path / "config.json").write_text(json.dumps(
        {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9}))
    return tmp_path


def test_an_unset_group_size_is_left_to_the_choice_from_the_model(model_dir):
    q.check_settings(model_dir, QuantizeConfig(method="rtn"))  # group_size null: nothing to reject yet
    chosen, how = q.resolve_group_size(model_dir, QuantizeConfig(method="rtn"))
    assert (chosen.group_size, how) == (64, "auto")
    q.check_settings(model_dir, chosen)


def test_a_group_size_that_does_not_divide_the_layers_fails(model_dir):
    with pytest.raises(ValueError, match=r"group_size=128 does not divide"):
        q.check_settings(model_dir, QuantizeConfig(method="rtn", group_size=128))
