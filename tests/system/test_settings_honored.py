"""Settings do what they say: ``model.trust_remote_code`` reaches the tokenizer and every engine (off by
default), LMDeploy honors every engine key or refuses it when the config loads, and the quantize group size
is chosen from the model when unset.

trust_remote_code is checked for real: a copy of the demo model whose config, model class and tokenizer are
code shipped in the folder (``auto_map``) fails to load without the flag and loads with it, through the
shard runner's tokenizer, the transformers engine and vLLM.
"""
from __future__ import annotations

import json
import textwrap

import pytest
from batch_llm.config import ConfigError, EngineConfig, QuantizeConfig
from batch_llm.engines.base import EngineStartError
from batch_llm.engines.lmdeploy_config import (
    PYTORCH_FIELDS,
    TURBOMIND_FIELDS,
    lmdeploy_backend_config,
    lmdeploy_problems,
    lmdeploy_request_refusal,
)
from helpers import custom_code_model, demo_config


@pytest.fixture(scope="module")
def custom_model(tmp_path_factory, demo_model_dir):
    return custom_code_model(demo_model_dir, tmp_path_factory.mktemp("custom") / "model")


# ------------------------------------------------------------------------------------------ trust_remote_code
def test_trust_remote_code_is_off_by_default(tmp_path):
    assert demo_config(tmp_path).model.trust_remote_code is False
    with pytest.raises(ConfigError, match="engine.extra.trust_remote_code: set model.trust_remote_code"):
        demo_config(tmp_path, engine__extra={"trust_remote_code": True})


def test_tokenizer_runs_shipped_code_only_when_trusted(custom_model):
    from batch_llm.stages.infer.request_builder import load_tokenizer

    with pytest.raises(ValueError, match="custom code"):
        load_tokenizer(str(custom_model), None)
    tok = load_tokenizer(str(custom_model), None, trust_remote_code=True)
    assert type(tok).__name__ == "SmolCustomTokenizer"  # the class from the folder's custom_tokenizer.py


def test_transformers_shard_runs_a_custom_code_model_only_when_trusted(tmp_path, custom_model):
    """End to end through the shard runner: its tokenizer and the transformers engine both get the flag."""
    from batch_llm import api
    from batch_llm.layout import RunLayout

    def run(trust: bool, sub: str):
        cfg = demo_config(tmp_path / sub, model__ref=str(custom_model), model__trust_remote_code=trust,
                          engine__kind="transformers", sharding__num_shards=1, sampling__max_tokens=4,
                          cache__enabled=False, engine__max_error_rate=1.0)
        layout = RunLayout.for_run(cfg, run_id=sub, ds="2026-11-04")
        model = api.fetch(cfg, layout)
        plan = api.plan_shards(cfg, layout)
        return api.infer_shard(cfg, layout, model, plan.shards[0].model_dump(), say=lambda _: None)

    with pytest.raises(EngineStartError, match="custom code"):
        run(False, "untrusted")
    m = run(True, "trusted")
    assert m.metrics.ok == m.metrics.rows > 0
    assert m.engine.settings["trust_remote_code"] is True


@pytest.fixture(scope="module")
def trusted_vllm(tmp_path_factory, custom_model):
    """One vLLM engine on the custom-code model, trusted, prefix caching on (shared by the tests below)."""
    from batch_llm.engines.vllm_engine import VllmEngine

    cfg = demo_config(tmp_path_factory.mktemp("vllm"), engine__max_model_len=512, engine__enforce_eager=True,
                      engine__enable_prefix_caching=True)
    engine = VllmEngine(str(custom_model), cfg.engine, cfg.sampling, trust_remote_code=True)
    info = engine.start()
    yield engine, info
    engine.close()


def test_vllm_gets_trust_remote_code(tmp_path, custom_model, trusted_vllm):
    from batch_llm.engines.vllm_engine import VllmEngine

    cfg = demo_config(tmp_path, engine__max_model_len=512, engine__enforce_eager=True)
    with pytest.raises(EngineStartError, match="custom code") as ei:
        VllmEngine(str(custom_model), cfg.engine, cfg.sampling).start()
    assert not ei.value.memory
    engine, info = trusted_vllm
    mc = engine.llm.llm_engine.vllm_config.model_config
    assert mc.trust_remote_code is True and info.settings["trust_remote_code"] is True
    assert type(mc.hf_config).__name__ == "SmolCustomConfig"  # the folder's own config class ran
    assert info.settings["model_context_limit"] == 8192
    # how it compiled and the graphs it captured, for the manifest: eager compiles nothing, and a CPU captures no graphs
    assert info.settings["compilation_mode"] == "NONE"
    assert info.settings["cudagraph_mode"] == "NONE" and info.settings["cudagraph_sizes"] == 0
    # whether vLLM overlapped its scheduling with the model's steps: read from its config, not assumed
    assert info.settings["async_scheduling"] is engine.llm.llm_engine.vllm_config.scheduler_config.async_scheduling
    assert isinstance(info.settings["async_scheduling"], bool)


def test_vllm_reports_prompt_tokens_served_from_its_prefix_cache(trusted_vllm, demo_model_dir):
    """Token usage per row: a second prompt sharing a long prefix with one already served reuses its KV blocks,
    and the result says how many prompt tokens that was (OpenAI's ``prompt_tokens_details.cached_tokens``)."""
    from batch_llm.engines.base import GenRequest
    from transformers import AutoTokenizer

    engine, _ = trusted_vllm
    tok = AutoTokenizer.from_pretrained(str(demo_model_dir))
    prefix = tok("Shared instructions: " + " ".join(f"Rule {i}: answer in one short sentence." for i in range(40)))
    prefix = prefix["input_ids"]
    first = prefix + tok(" Question: name a colour.")["input_ids"]
    second = prefix + tok(" Question: name a fruit.")["input_ids"]
    (a,) = list(engine.generate([GenRequest("a", first)]))
    (b,) = list(engine.generate([GenRequest("b", second)]))   # after the first finished: its blocks are cached
    assert len(prefix) > 200 and a.prompt_tokens == len(first) and b.prompt_tokens == len(second)
    assert a.cached_prompt_tokens < len(prefix)
    assert len(prefix) // 2 < b.cached_prompt_tokens <= len(prefix), (b.cached_prompt_tokens, len(prefix))


# ------------------------------------------------------------------------------------------ LMDeploy
def _lmdeploy(**engine) -> EngineConfig:
    return EngineConfig(kind="lmdeploy", **engine)


def test_lmdeploy_maps_every_engine_key_onto_its_config():
    cfg = _lmdeploy(max_model_len=4096, max_num_seqs=128, gpu_memory_utilization=0.85, tensor_parallel_size=2,
                    dtype="bfloat16", quantization="fp8", kv_cache_dtype="int8", enforce_eager=True,
                    enable_prefix_caching=True, extra={"block_size": 128, "max_prefill_token_num": 4096})
    backend, kw = lmdeploy_backend_config(cfg)
    assert backend == "pytorch"
    assert kw == dict(session_len=4096, max_batch_size=128, cache_max_entry_count=0.85, tp=2, dtype="bfloat16",
                      model_format="fp8", quant_policy=8, eager_mode=True, enable_prefix_caching=True,
                      block_size=128, max_prefill_token_num=4096)
    assert set(kw) <= PYTORCH_FIELDS

    tm = _lmdeploy(quantization="awq", kv_cache_dtype="int4", enable_prefix_caching=False, dtype="half",
                   extra={"backend": "turbomind", "cache_block_seq_len": 128, "communicator": "cuda-ipc"})
    backend, kw = lmdeploy_backend_config(tm)
    assert backend == "turbomind" and set(kw) <= TURBOMIND_FIELDS
    assert kw == dict(session_len=2048, max_batch_size=256, cache_max_entry_count=0.9, tp=1, dtype="float16",
                      model_format="awq", quant_policy=4, enable_prefix_caching=False, cache_block_seq_len=128,
                      communicator="cuda-ipc")
    # the defaults are honored as they are (LMDeploy's own prefix-caching default when unset)
    _, kw = lmdeploy_backend_config(_lmdeploy())
    assert "enable_prefix_caching" not in kw and "model_format" not in kw and kw["quant_policy"] == 0


@pytest.mark.parametrize("engine, key", [
    ({"extra": {"no_such_field": 1}}, "engine.extra.no_such_field"),
    ({"extra": {"backend": "turbomind", "eager_mode": True}}, "engine.extra.eager_mode"),  # mapped: use the key
    ({"extra": {"session_len": 4096}}, "engine.extra.session_len: set engine.max_model_len"),
    ({"extra": {"backend": "tensorrt"}}, "engine.extra.backend"),
    ({"extra": {"backend": "turbomind", "block_size": 64}}, "engine.extra.block_size"),  # a PyTorch-only field
    ({"quantization": "awq"}, "engine.quantization"),          # the PyTorch engine reads it from the checkpoint
    ({"quantization": "bitsandbytes", "extra": {"backend": "turbomind"}}, "engine.quantization"),
    ({"kv_cache_dtype": "fp8", "extra": {"backend": "turbomind"}}, "engine.kv_cache_dtype"),
    ({"kv_cache_dtype": "fp8_e4m3fnuz"}, "engine.kv_cache_dtype"),
    ({"dtype": "float32"}, "engine.dtype"),
    ({"gpu_memory_utilization": 1.0}, "engine.gpu_memory_utilization"),
    ({"enforce_eager": True, "extra": {"backend": "turbomind"}}, "engine.enforce_eager"),
    ({"cpu_kv_cache_gib": 8}, "engine.cpu_kv_cache_gib"),
    ({"batch_size": 64}, "engine.batch_size"),
])
def test_lmdeploy_refuses_at_config_load_what_it_cannot_honor(tmp_path, engine, key):
    over = {f"engine__{k}": v for k, v in {"kind": "lmdeploy", "enforce_eager": False, **engine}.items()}
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as ei:
        demo_config(tmp_path, **over)
    assert "demo.yaml" in str(ei.value) or "params" in str(ei.value)  # the usual "<file>: <key>: ..." form
    # the same keys are fine on vLLM, which passes them on
    if engine.get("quantization") is None and "extra" not in engine and "batch_size" not in engine:
        demo_config(tmp_path, **{**over, "engine__kind": "vllm"})


def test_lmdeploy_demo_config_loads_and_names_no_problem(tmp_path):
    cfg = demo_config(tmp_path, engine__kind="lmdeploy")  # the demo's enforce_eager becomes eager_mode
    assert lmdeploy_problems(cfg.engine) == []
    assert lmdeploy_backend_config(cfg.engine)[1]["eager_mode"] is True


def test_lmdeploy_request_errors_are_rows_engine_errors_fail_the_shard():
    class RequestError(RuntimeError):  # LMDeploy 0.18's serve.core.exceptions.RequestError carries a code
        def __init__(self, code):
            super().__init__(code)
            self.code = code

    for code in ("invalid_request", "context_length_exceeded", "unsupported_feature", "preprocess_failed"):
        assert lmdeploy_request_refusal(RequestError(code)), code
    for code in ("engine_unavailable", "internal_error", "request_conflict"):
        assert not lmdeploy_request_refusal(RequestError(code)), code
    assert lmdeploy_request_refusal(ValueError("bad gen config"))
    assert not lmdeploy_request_refusal(RuntimeError("CUDA error: an illegal memory access was encountered"))


# ------------------------------------------------------------------------------------------ quantize group size
def _model(tmp_path, name, **config):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    return d


def test_group_size_is_chosen_from_the_model_when_unset(tmp_path, demo_model_dir):
    from batch_llm.stages import quantize as q

    assert QuantizeConfig().group_size is None
    assert q.choose_group_size(demo_model_dir) == 64  # SmolLM2-135M: hidden 576 = 4.5 x 128
    assert q.choose_group_size(_model(tmp_path, "qwen7b", hidden_size=3584, intermediate_size=18944,
                                      num_attention_heads=28)) == 128
    assert q.choose_group_size(_model(tmp_path, "h608", hidden_size=608, intermediate_size=1216)) == 32
    assert q.choose_group_size(_model(tmp_path, "vl", text_config={"hidden_size": 2048,
                                                                   "intermediate_size": 5632})) == 128
    with pytest.raises(ValueError, match="none of"):
        q.choose_group_size(_model(tmp_path, "h100", hidden_size=100))
    with pytest.raises(ValueError, match="set quantize.group_size"):
        q.choose_group_size(tmp_path / "missing")
    explicit = QuantizeConfig(group_size=32)
    assert q.resolve_group_size(demo_model_dir, explicit) == (explicit, "configured")
    auto, how = q.resolve_group_size(demo_model_dir, QuantizeConfig())
    assert (auto.group_size, how) == (64, "auto")


def test_chosen_group_size_is_recorded_and_keys_the_cache(tmp_path, demo_model_dir):
    """quantize_model with group_size unset: the exporter gets the chosen size, the result records it, and
    the cache entry is the one an explicit 64 would use (the AWQ export itself is faked: it is slow)."""
    from batch_llm.stages import quantize as q

    seen = tmp_path / "seen.json"
    fake = tmp_path / "fake-python"
    fake.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        echo "$5" > {seen}
        tmp="$4.partial"; mkdir -p "$tmp"
        echo '{{}}' > "$tmp/config.json"
        echo '{{"method": "rtn", "scheme": "W4A16", "group_size": 64, "size_bytes": 1}}' > "$tmp/{q.INFO_FILE}"
        mv "$tmp" "$4"
        """))
    fake.chmod(0o755)
    cfg = QuantizeConfig(enabled=True, method="rtn", cache_dir=str(tmp_path / "cache"), python=str(fake))
    result = q.quantize_model(str(demo_model_dir), cfg, model_key="smol")
    assert json.loads(seen.read_text())["group_size"] == 64
    assert result["group_size"] == 64 and result["group_size_chosen"] == "auto" and not result["cache_hit"]
    again = q.quantize_model(str(demo_model_dir), cfg.model_copy(update={"group_size": 64}), model_key="smol")
    assert again["cache_hit"] and again["model_dir"] == result["model_dir"] and "-g64-" in again["model_dir"]
    assert again["group_size_chosen"] == "configured"
