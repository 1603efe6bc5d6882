"""One identity of what changes an output (``infer.identity.output_identity``) keys both the result cache's namespace and a
shard's resume: every engine setting that reaches the engine is in it unless named, with the reason, in
``ENGINE_FIELDS_NOT_IN_OUTPUT``; a changed setting re-runs the rows and the shard says which setting changed."""
from __future__ import annotations

import json

import pytest
from batch_llm import api
from batch_llm.config import EngineConfig
from batch_llm.host import probes
from batch_llm.io import identity
from batch_llm.io.storage import Location, iter_jsonl
from batch_llm.layout import RunLayout
from batch_llm.manifests import ModelRef, ShardSpec
from batch_llm.stages.infer.identity import shard_input_key, shard_inputs
from helpers import cache_namespace, demo_config, use_echo_engine

LABELS = ["yes", "no"]

# For every engine field in the identity: (the config it is changed from, the change), as config overrides.
ENGINE_CHANGES = {
    "kind": ({}, {"engine.kind": "transformers", "engine.enforce_eager": False}),
    "task": ({}, {"engine.task": "embed"}),
    "embed": ({"engine.task": "embed"}, {"engine.task": "embed", "engine.embed": {"normalize": False}}),
    "classify": ({"engine.task": "classify", "engine.classify": {"labels": LABELS}},
                 {"engine.task": "classify", "engine.classify": {"labels": [*LABELS, "maybe"]}}),
    "max_model_len": ({}, {"engine.max_model_len": 4096}),
    "dtype": ({}, {"engine.dtype": "float16"}),
    "quantization": ({}, {"engine.quantization": "fp8"}),
    "kv_cache_dtype": ({}, {"engine.kv_cache_dtype": "fp8"}),
    "speculative": ({}, {"engine.speculative": {}}),
    "extra": ({}, {"engine.extra": {"max_logprobs": 30}}),
    "python": ({}, {"engine.python": "/opt/other-venv/bin/python"}),
    "limit_mm_per_prompt": ({}, {"engine.limit_mm_per_prompt": {"image": 2}}),
    "mm_processor_kwargs": ({}, {"engine.mm_processor_kwargs": {"max_pixels": 1003520}}),
    # auto finds none for the demo model: the key holds the parser only where there is one
    "reasoning_parser": ({}, {"engine.reasoning_parser": "qwen3"}),
    # the precision the gate chooses serves the rows: in the key only where the gate runs
    "precision": ({}, {"engine.precision": "auto"}),
    "precision_gate": ({"engine.precision": "auto"},
                       {"engine.precision": "auto", "engine.precision_gate": {"min_agreement": 0.5}}),
}

# For every field left out: a change that must not move the keys.
ENGINE_SAME = {
    "max_num_seqs": 8, "gpu_memory_utilization": 0.5, "tensor_parallel_size": 2, "cpu_kv_cache_gib": 4,
    "batch_size": 4, "enforce_eager": False, "cuda_graphs": "vllm", "torch_compile": True, "compile_cache": "/tmp/cc",
    "multiprocessing": True, "enable_prefix_caching": True, "memory_backoff": {"max_attempts": 2}, "replicas": 2,
    "replica_start": "before", "commit_every_rows": 3, "commit_every_seconds": 5.0, "progress_every_seconds": 1.0,
    "max_error_rate": 0.5,
    "dedupe_prompts": False, "sglang": {"cuda_graph_max_bs": 64, "chunked_prefill_size": 2048,
                                        "deterministic_inference": True},
}
# Fields of one engine's own section: changed on that engine.
ENGINE_OF = {"sglang": {"engine.kind": "sglang"}}


def test_every_engine_field_is_in_the_identity_or_excluded_by_name():
    """A field added to EngineConfig fails here until it is given a change above (it is in the keys by
    default) or is named in ENGINE_FIELDS_NOT_IN_OUTPUT with its reason."""
    fields = set(EngineConfig.model_fields)
    assert identity.ENGINE_FIELDS_NOT_IN_OUTPUT <= fields, "an exclusion names no field"
    assert set(ENGINE_CHANGES) == fields - identity.ENGINE_FIELDS_NOT_IN_OUTPUT
    assert set(ENGINE_SAME) == set(identity.ENGINE_FIELDS_NOT_IN_OUTPUT)


def _keys(tmp_path, overrides: dict) -> tuple[str, str, dict[str, str]]:
    """(the shard's resume key, the cache namespace, the shard's inputs by part) for the demo pipeline."""
    cfg = demo_config(tmp_path).with_overrides(overrides)
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    ref = ModelRef(local_dir=str(model), model_key="m@main#abc")
    shard = ShardSpec(index=0, rows=1, url=str(tmp_path / "rows.jsonl"), plan_key="p" * 16)
    ns = cache_namespace(tmp_path, **{k.replace(".", "__"): v for k, v in overrides.items()})
    return shard_input_key(cfg, ref, shard), ns, shard_inputs(cfg, ref, shard)


@pytest.mark.parametrize("field", sorted(ENGINE_CHANGES))
def test_an_engine_setting_that_reaches_the_engine_changes_both_keys(tmp_path, field):
    before, after = ENGINE_CHANGES[field]
    key, ns, parts = _keys(tmp_path, before)
    key2, ns2, parts2 = _keys(tmp_path, after)
    assert key2 != key and ns2 != ns
    assert f"engine settings changed: {field}" in identity.what_changed(parts, parts2)


@pytest.mark.parametrize("field", sorted(ENGINE_SAME))
def test_an_engine_setting_that_only_schedules_changes_neither_key(tmp_path, field):
    base = ENGINE_OF.get(field, {})
    assert _keys(tmp_path, {**base, f"engine.{field}": ENGINE_SAME[field]})[:2] == _keys(tmp_path, base)[:2]


@pytest.mark.parametrize("change", [{"sampling.temperature": 0.7}, {"sampling.max_tokens": 9},
                                    {"sampling.stop": ["END"]},
                                    {"sampling.output_schema": {"type": "object", "properties": {"a": {"type": "string"}}}},
                                    {"model.chat_template": "{{ messages }}"}, {"model.trust_remote_code": True}])
def test_sampling_the_schema_and_the_template_change_both_keys(tmp_path, change):
    assert set(_keys(tmp_path, change)[:2]).isdisjoint(_keys(tmp_path, {})[:2])


def test_the_weights_and_the_adapter_change_both_keys(tmp_path):
    """LoRA and quantization reach the keys through the model key (fetch: ``+lora#<adapter hash>``)."""
    cfg = demo_config(tmp_path)
    shard = ShardSpec(index=0, rows=1, url="x", plan_key="p" * 16)

    def key(model_key: str) -> str:
        return shard_input_key(cfg, ModelRef(local_dir=str(tmp_path), model_key=model_key), shard)

    assert len({key("m@main#abc"), key("m@main#abd"), key("m@main#abc+lora#0123")}) == 3


def test_auto_dtype_is_keyed_as_the_engine_will_run_it(tmp_path, monkeypatch):
    """auto on a CPU without native bfloat16 runs float32: the same key as float32 there, another on a GPU."""
    monkeypatch.setattr(probes, "cpu_has_native_bf16", lambda: False)
    monkeypatch.setattr(identity, "engine_on_gpu", lambda: False)
    assert _keys(tmp_path, {"engine.dtype": "auto"})[:2] == _keys(tmp_path, {"engine.dtype": "float32"})[:2]
    monkeypatch.setattr(identity, "engine_on_gpu", lambda: True)
    assert _keys(tmp_path, {"engine.dtype": "auto"})[:2] != _keys(tmp_path, {"engine.dtype": "float32"})[:2]


# ------------------------------------------------------------------------------------------ a shard, run
@pytest.fixture
def echo_engine(monkeypatch, demo_model_dir):
    return use_echo_engine(monkeypatch)


def _run(cfg, run_id: str, said: list[str] | None = None):
    layout = RunLayout.for_run(cfg, run_id=run_id, ds="2026-12-04")
    plan = api.plan_shards(cfg, layout)
    return api.infer_shard(cfg, layout, api.fetch(cfg, layout), plan.shards[0],
                              say=(said.append if said is not None else lambda _: None))


def test_a_float32_run_is_not_served_a_bfloat16_runs_outputs(tmp_path, echo_engine):
    base = dict(engine__kind="transformers", engine__enforce_eager=False, sharding__num_shards=1,
                sampling__max_tokens=8)
    bf16 = demo_config(tmp_path, engine__dtype="bfloat16", **base)
    assert _run(bf16, "a").metrics.cached_rows == 0
    asked = echo_engine.requests
    m = _run(demo_config(tmp_path, engine__dtype="float32", **base), "b")
    assert m.metrics.cached_rows == 0 and echo_engine.requests == 2 * asked
    m = _run(bf16, "c")  # the same settings again: served from the cache
    assert m.metrics.cached_rows == m.metrics.rows and echo_engine.requests == 2 * asked


def test_a_row_failed_as_too_long_is_run_again_once_max_model_len_is_raised(tmp_path, echo_engine):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": "short", "prompt": "Hi"}) + "\n" +
                   json.dumps({"id": "long", "prompt": "word " * 300}) + "\n")
    base = dict(input__path=str(src), engine__kind="transformers", engine__enforce_eager=False,
                engine__max_error_rate=1.0, sharding__num_shards=1, sampling__max_tokens=8)
    m = _run(demo_config(tmp_path, engine__max_model_len=64, **base), "r")
    errors = list(iter_jsonl(Location(m.errors).path()))
    assert [e["id"] for e in errors] == ["long"] and "max_model_len" in errors[0]["error"]
    said: list[str] = []
    m = _run(demo_config(tmp_path, engine__max_model_len=1024, **base), "r", said)  # the same run, re-run
    assert m.metrics.errors == 0 and sorted(r["id"] for r in iter_jsonl(Location(m.outputs).path())) == ["long", "short"]
    assert any("engine settings changed: max_model_len" in line for line in said), said
    layout = RunLayout.for_run(demo_config(tmp_path, **base), run_id="r", ds="2026-12-04")
    marker = json.loads(layout.stage("infer").child("shard-00000", "inputs.json").path().read_text())
    assert marker["started_over"] == "engine settings changed: max_model_len"
