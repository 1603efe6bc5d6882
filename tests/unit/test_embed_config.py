"""engine.task embed (and classify, where they share a rule): what the config refuses, the cache namespace it
keys on, the manifests it skips."""
from __future__ import annotations

import pytest
from batch_llm.config import ConfigError
from batch_llm.io.storage import Location
from helpers import cache_namespace, demo_config


def test_embed_is_off_by_default_and_loads_on_vllm(tmp_path):
    assert demo_config(tmp_path).engine.task == "generate"
    cfg = demo_config(tmp_path, engine__task="embed")
    assert cfg.engine.task == "embed" and cfg.engine.embed.normalize is True
    assert demo_config(tmp_path, engine__task="embed", engine__embed={"normalize": False}).engine.embed.normalize \
        is False


@pytest.mark.parametrize("kind", ["transformers", "lmdeploy"])
def test_embed_refused_for_other_engines(tmp_path, kind):
    with pytest.raises(ConfigError, match=r"engine: .*task: embed runs on vLLM's pooling runner.*engine.kind: vllm"):
        demo_config(tmp_path, engine__task="embed", engine__kind=kind)


@pytest.mark.parametrize("override, named", [
    ({"sampling.n": 2}, "sampling.n"),
    ({"sampling.logprobs": 3}, "sampling.logprobs"),
    ({"sampling.output_schema": {"type": "object", "properties": {"a": {"type": "string"}}}},
     "sampling.output_schema"),
    ({"input.sampling_columns": ["max_tokens", "temperature"]}, "input.sampling_columns: temperature"),
])
def test_embed_refuses_generation_settings(tmp_path, override, named):
    with pytest.raises(ConfigError, match=rf"{named}.*engine.task: embed generates no text"):
        demo_config(tmp_path, engine__task="embed", **{k.replace(".", "__"): v for k, v in override.items()})


def test_embed_settings_refused_without_embed(tmp_path):
    with pytest.raises(ConfigError, match=r"engine.embed: settings of engine.task: embed"):
        demo_config(tmp_path, engine__embed={"normalize": False})
    with pytest.raises(ConfigError, match=r"unknown key 'dimensions'"):  # vLLM 0.32 refuses it for SmolLM2-like models
        demo_config(tmp_path, engine__task="embed", engine__embed={"dimensions": 64})


def test_embed_refuses_a_served_adapter(tmp_path):
    with pytest.raises(ConfigError, match=r"model.lora.merge: false.*engine.task: embed"):
        demo_config(tmp_path, engine__task="embed", model__lora={"ref": str(tmp_path), "merge": False})


def test_the_cache_never_serves_text_for_an_embed_request(tmp_path):
    generate = cache_namespace(tmp_path)
    embed = cache_namespace(tmp_path, engine__task="embed")
    assert embed != generate
    assert cache_namespace(tmp_path, engine__task="embed", engine__embed={"normalize": False}) not in (embed, generate)
    # the sampling decides no vector: another temperature is the same embed namespace
    assert cache_namespace(tmp_path, engine__task="embed", sampling__temperature=0.5) == embed
    assert cache_namespace(tmp_path, sampling__temperature=0.5) != generate


def test_openai_batch_input_refused_for_classify(tmp_path):
    from batch_llm.stages.plan import write_plan

    src = tmp_path / "batch.jsonl"
    src.write_text('{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", '
                   '"body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}\n')
    cfg = demo_config(tmp_path, engine__task="classify", input__path=str(src))
    with pytest.raises(ValueError, match=r"OpenAI Batch input .* engine.task: classify writes class probabilities"):
        write_plan(cfg, input_loc=Location(str(src)), plan_dir=Location(str(tmp_path / "plan")))
