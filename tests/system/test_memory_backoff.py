"""Memory back-off on the real vLLM engine: a KV cache too small for max_model_len fails the first start;
the runner retries with the max_model_len vLLM says fits (within bounds), logs it, and records the attempts."""
from __future__ import annotations

import pytest
from batch_llm.engines.base import EngineStartError, classify_start_failure
from batch_llm.engines.start import smaller_settings, start_engine
from helpers import demo_config


def test_classify_start_failure():
    msg = ("ValueError: To serve at least one request with the model's max seq len (8192), (0.18 GiB KV cache is "
           "needed, which is larger than the available KV cache memory (0.05 GiB). Based on the available "
           "memory, the estimated maximum model length is 2176. Try increasing `gpu_memory_utilization`")
    assert classify_start_failure(msg) == (True, 2176)
    assert classify_start_failure("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate") == (True, None)
    assert classify_start_failure("ValueError: unknown architecture Foo") == (False, None)


def test_smaller_settings_stay_within_bounds(tmp_path):
    e = demo_config(tmp_path).engine.model_copy(update={"gpu_memory_utilization": 0.9, "max_num_seqs": 64})
    step = smaller_settings(e, EngineStartError("oom", memory=True))
    assert step == {"gpu_memory_utilization": 0.85, "max_num_seqs": 32}
    floor = e.model_copy(update={"gpu_memory_utilization": 0.5, "max_num_seqs": 8, "max_model_len": 512})
    assert smaller_settings(floor, EngineStartError("oom", memory=True)) is None
    by_len = smaller_settings(e, EngineStartError("kv", memory=True, suggested_max_model_len=1000))
    assert by_len == {"max_model_len": 992}


def test_vllm_start_backs_off_to_a_context_that_fits(tmp_path, demo_model_dir):
    cfg = demo_config(tmp_path, engine__max_model_len=8192,
                      engine__extra={"kv_cache_memory_bytes": 40 * 1024 * 1024})  # ~1.7k tokens of KV cache
    said: list[str] = []
    engine, info = start_engine(str(demo_model_dir), cfg, said.append)
    try:
        assert len(info.attempts) == 2
        assert info.attempts[0]["memory"] and info.attempts[0]["max_model_len"] == 8192
        assert info.attempts[1]["ok"]
        assert 512 <= info.settings["max_model_len"] < 8192
        assert any("failed for memory" in s and "max_model_len" in s for s in said)
    finally:
        engine.close()


def test_non_memory_failure_is_not_retried(tmp_path):
    bad = tmp_path / "not_a_model"
    bad.mkdir()
    (bad / "config.json").write_text('{"architectures": ["NoSuchModelForCausalLM"], "model_type": "nosuch"}')
    cfg = demo_config(tmp_path)
    with pytest.raises(EngineStartError) as ei:
        start_engine(str(bad), cfg, print)
    assert not ei.value.memory


def test_probe_sizes_the_batch_from_the_kv_cache_and_keeps_the_margin(tmp_path, demo_model_dir):
    """One start shows how big the KV cache is; the engine restarts with the most sequences of max_model_len
    tokens that fit, less the safety margin (here 20 %), and the shard's settings say so."""
    cfg = demo_config(tmp_path, engine__max_model_len=1024, engine__enforce_eager=True,
                      engine__extra={"kv_cache_memory_bytes": 512 * 1024 * 1024},
                      engine__memory_backoff={"probe": True, "safety_margin": 0.2})
    said: list[str] = []
    engine, info = start_engine(str(demo_model_dir), cfg, said.append)
    try:
        s = info.settings
        fits = s["num_kv_blocks"] * s["block_size"] // 1024
        assert 4 <= fits < 256, s  # 512 MiB at ~23 KB a token (SmolLM2-135M): ~22 sequences of 1k tokens
        assert s["max_num_seqs"] == int(fits * 0.8) == s["probe"]["max_num_seqs"]
        assert s["probe"]["sequences_that_fit"] == fits
        assert [a.get("max_num_seqs") for a in info.attempts] == [None, int(fits * 0.8)]
        assert any(line.startswith("probe: the KV cache holds") and "keeps 20% free" in line for line in said)
        # the engine that runs is the restarted one, at the probed size
        assert engine.llm.llm_engine.vllm_config.scheduler_config.max_num_seqs == int(fits * 0.8)
    finally:
        engine.close()


def test_probe_is_refused_for_engines_without_a_kv_cache_report(tmp_path):
    with pytest.raises(Exception, match="probe sizes vLLM's batch"):
        demo_config(tmp_path, engine__kind="transformers", engine__memory_backoff={"probe": True})
