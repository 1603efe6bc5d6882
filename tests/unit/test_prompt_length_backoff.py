"""A prompt longer than the context the engine actually started with is a row error with its reason, also when
a memory back-off lowered max_model_len below engine.max_model_len (the engine would fail the shard for it)."""
from __future__ import annotations

from batch_llm.engines import start as engine_start
from batch_llm.engines.base import EngineInfo, EngineStartError, GenResult
from batch_llm.io.storage import Location, iter_jsonl, write_jsonl
from batch_llm.manifests import ShardSpec
from batch_llm.stages.infer.runner import run_shard
from helpers import demo_config


class _ShortOfMemory:
    """Stands in for vLLM: the first start fails for memory and suggests a shorter context; the engine then
    fails outright on a prompt that does not fit it, as vLLM's does."""

    starts: list[int | None] = []

    def __init__(self, model_dir, ecfg, sampling, **kw):
        self.max_model_len = ecfg.max_model_len

    def start(self) -> EngineInfo:
        _ShortOfMemory.starts.append(self.max_model_len)
        if len(_ShortOfMemory.starts) == 1:
            raise EngineStartError("KV cache is too small for max_model_len", memory=True, suggested_max_model_len=600)
        return EngineInfo(kind="vllm", version="0", settings={"max_model_len": self.max_model_len})

    def generate(self, requests):
        for req in requests:
            if len(req.prompt_token_ids) >= self.max_model_len:
                raise RuntimeError(f"prompt of {len(req.prompt_token_ids)} tokens > max_model_len: engine dead")
            yield GenResult(req.key, text="ok", finish_reason="stop", prompt_tokens=len(req.prompt_token_ids),
                            completion_tokens=1)

    def close(self) -> None:
        pass


def test_a_prompt_over_the_backed_off_context_is_a_row_error(tmp_path, monkeypatch):
    monkeypatch.setattr(engine_start, "make_engine", _ShortOfMemory)
    _ShortOfMemory.starts = []
    cfg = demo_config(tmp_path, engine__max_model_len=2048, engine__max_error_rate=1.0, cache__enabled=False)
    shard_file = tmp_path / "shard.jsonl"
    write_jsonl(Location(str(shard_file)).path(), [
        {"id": "short", "idx": 0, "prompt_token_ids": [1] * 100},
        {"id": "long", "idx": 1, "prompt_token_ids": [1] * 1000},  # fits 2048, not the 592 of the back-off
    ])
    m = run_shard(cfg, shard=ShardSpec(index=0, rows=2, url=str(shard_file)),
                  shard_dir=Location(str(tmp_path / "shard-00000")), model_dir=str(tmp_path), model_key="m",
                  say=lambda _: None)
    assert _ShortOfMemory.starts == [2048, 592]
    assert [r["id"] for r in iter_jsonl(Location(m.outputs).path())] == ["short"]
    (err,) = iter_jsonl(Location(m.errors).path())
    assert err["id"] == "long" and "prompt is 1000 tokens" in err["error"] and "is 592" in err["error"], err
    assert "memory back-off" in err["error"]
