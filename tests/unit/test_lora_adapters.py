"""LoRA adapters without an engine: a bad adapter is refused at fetch, naming it and the fault; a served adapter
needs an engine that serves one."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from batch_llm.config import ConfigError
from batch_llm.host.probes import vllm_max_lora_rank
from batch_llm.stages.fetch import fetch_model
from batch_llm.stages.lora import AdapterInvalid, check_adapter
from helpers import demo_config

HIDDEN = 576  # SmolLM2-135M's hidden size; its k/v projections are 192 wide (3 KV heads of 64)


def _adapter(path: Path, shapes: dict[str, tuple[int, int]], *, config: dict | None = None) -> Path:
    """An adapter folder as peft writes one (adapter_config.json, adapter_model.safetensors), non-zero weights."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps(config or {
        "peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"],
        "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct", "task_type": "CAUSAL_LM"}))
    g = torch.Generator().manual_seed(0)
    save_file({f"base_model.model.{k}": torch.randn(s, generator=g) for k, s in shapes.items()},
              path / "adapter_model.safetensors")
    return path


def _fitting(path: Path) -> Path:
    return _adapter(path, {"model.layers.0.self_attn.q_proj.lora_A.weight": (8, HIDDEN),
                           "model.layers.0.self_attn.q_proj.lora_B.weight": (HIDDEN, 8),
                           "model.layers.0.self_attn.v_proj.lora_A.weight": (8, HIDDEN),
                           "model.layers.0.self_attn.v_proj.lora_B.weight": (192, 8)})


def test_a_fitting_adapter_passes(tmp_path, demo_model_dir):
    info = check_adapter("my/adapter", str(_fitting(tmp_path / "a")), str(demo_model_dir))
    assert info.rank == 8 and info.weights == "adapter_model.safetensors"
    assert vllm_max_lora_rank(info.rank) == 8 and vllm_max_lora_rank(12) == 16


def test_an_adapter_of_another_base_is_refused_at_fetch_naming_it(tmp_path, demo_model_dir):
    """Trained on a model with hidden size 896: every matrix is the wrong width. Fetch refuses it before any merge."""
    bad = _adapter(tmp_path / "qwen-adapter", {"model.layers.0.self_attn.q_proj.lora_A.weight": (8, 896),
                                               "model.layers.0.self_attn.q_proj.lora_B.weight": (896, 8)})
    cache = tmp_path / "model-cache"
    cfg = demo_config(tmp_path, model__ref=str(demo_model_dir), model__cache_dir=str(cache),
                      model__lora={"ref": str(bad)})
    with pytest.raises(AdapterInvalid) as e:
        fetch_model(cfg.model)
    msg = str(e.value)
    assert f"model.lora.ref {bad}" in msg and "does not fit the base model" in msg
    assert "q_proj.lora_A.weight has shape [8, 896]" in msg and "[576, 576]" in msg
    assert not (cache / "merged").exists()  # refused before any merge


def test_an_adapter_for_modules_the_base_lacks_is_refused(tmp_path, demo_model_dir):
    bad = _adapter(tmp_path / "a", {"model.layers.99.self_attn.q_proj.lora_A.weight": (8, HIDDEN),
                                    "model.layers.99.self_attn.q_proj.lora_B.weight": (HIDDEN, 8)})
    with pytest.raises(AdapterInvalid, match=r"model\.layers\.99\.self_attn\.q_proj is not a module of the base"):
        check_adapter("my/adapter", str(bad), str(demo_model_dir))


@pytest.mark.parametrize("remove, expected", [
    ("adapter_model.safetensors", "no adapter weights (adapter_model.safetensors or adapter_model.bin)"),
    ("adapter_config.json", "no adapter_config.json"),
])
def test_a_missing_file_is_named(tmp_path, demo_model_dir, remove, expected):
    adapter = _fitting(tmp_path / "a")
    (adapter / remove).unlink()
    with pytest.raises(AdapterInvalid) as e:
        check_adapter("owner/my-adapter", str(adapter), str(demo_model_dir))
    assert str(e.value).startswith(f"model.lora.ref owner/my-adapter: {expected}") and str(adapter) in str(e.value)


def test_a_truncated_weights_file_and_a_non_lora_config_are_refused(tmp_path, demo_model_dir):
    adapter = _fitting(tmp_path / "a")
    (adapter / "adapter_model.safetensors").write_text("version https://git-lfs.github.com/spec/v1\n")
    with pytest.raises(AdapterInvalid, match="adapter_model.safetensors is not a readable weights file"):
        check_adapter("a", str(adapter), str(demo_model_dir))
    shutil.rmtree(adapter)
    ia3 = _adapter(tmp_path / "a", {}, config={"peft_type": "IA3"})
    with pytest.raises(AdapterInvalid, match="not a LoRA adapter's .peft_type 'IA3'"):
        check_adapter("a", str(ia3), str(demo_model_dir))


def test_a_missing_adapter_folder_names_the_key(tmp_path, demo_model_dir):
    cfg = demo_config(tmp_path, model__ref=str(demo_model_dir), model__lora={"ref": str(tmp_path / "nowhere")})
    with pytest.raises(FileNotFoundError, match="model.lora.ref .*nowhere: no such folder"):
        fetch_model(cfg.model)


@pytest.mark.parametrize("kind", ["transformers", "lmdeploy"])
def test_a_served_adapter_needs_vllm(tmp_path, kind):
    with pytest.raises(ConfigError, match=f"model.lora.merge: false serves the adapter unmerged, which engine {kind} "
                                          "cannot .vllm and sglang can.; set model.lora.merge: true"):
        demo_config(tmp_path, engine__kind=kind, model__lora={"ref": "owner/adapter", "merge": False})
    # merged, any engine takes it; unknown keys are refused as everywhere
    assert demo_config(tmp_path, engine__kind=kind, model__lora={"ref": "owner/adapter"}).model.lora.merge
    with pytest.raises(ConfigError, match="unknown key 'merged'"):
        demo_config(tmp_path, model__lora={"ref": "owner/adapter", "merged": True})


def test_the_fetch_task_fails_without_retries_on_a_bad_adapter(tmp_path, demo_model_dir):
    """A retry finds the same adapter: the fetch operator fails at once (AirflowFailException), naming it."""
    import datetime as dt
    from types import SimpleNamespace

    from airflow.sdk.exceptions import AirflowFailException
    from batch_llm_airflow.operators import FetchModelOperator

    adapter = _fitting(tmp_path / "a")
    (adapter / "adapter_model.safetensors").unlink()
    cfg = demo_config(tmp_path, model__ref=str(demo_model_dir), model__lora={"ref": str(adapter)})
    op = FetchModelOperator(task_id="fetch_model", pipeline_config=cfg.model_dump(mode="json"), retries=3)
    day = dt.datetime(2026, 12, 1, tzinfo=dt.timezone.utc)
    context = {"dag_run": SimpleNamespace(logical_date=day, run_after=day, clear_number=0), "run_id": "manual__t",
               "params": {}}
    with pytest.raises(AirflowFailException, match=f"model.lora.ref {adapter}: no adapter weights"):
        op.execute(context)


def test_a_served_adapter_travels_with_the_model_reference(tmp_path, demo_model_dir):
    """merge: false keeps the model folder and hands the adapter's folder on: through the quantize stage and the
    reference's JSON form (XCom, the worker's stdin) to the shard; an engine that cannot serve one refuses it."""
    from batch_llm import api
    from batch_llm.engines.registry import make_engine
    from batch_llm.layout import RunLayout
    from batch_llm.manifests import ModelRef

    adapter = _fitting(tmp_path / "a")
    cfg = demo_config(tmp_path, model__ref=str(demo_model_dir), model__lora={"ref": str(adapter), "merge": False})
    layout = RunLayout.for_run(cfg, run_id="t", ds="2026-12-01")
    fetched = api.fetch(cfg, layout)
    assert fetched.local_dir == str(demo_model_dir) and fetched.adapter.mode == "serve" and fetched.adapter.rank == 8
    assert "+lora#" in fetched.model_key
    ref = ModelRef.of(api.quantize(cfg, layout, fetched.ref().model_dump(mode="json")).ref().model_dump(mode="json"))
    assert ref.lora_dir == str(adapter) and ref.model_key == fetched.model_key
    with pytest.raises(ValueError, match="engine transformers cannot serve a LoRA adapter unmerged"):
        make_engine(ref.local_dir, cfg.engine.model_copy(update={"kind": "transformers"}), cfg.sampling,
                    lora_dir=ref.lora_dir)


@pytest.mark.parametrize("dtype, served, on_gpu, refused", [
    ("float32", True, True, True), ("float", True, True, True),
    ("bfloat16", True, True, False), ("float16", True, True, False), ("auto", True, True, False),
    ("float32", False, True, False),  # merged at fetch: an ordinary model in any dtype
    ("float32", True, False, False),  # vLLM's CPU LoRA kernels take float32 (the CPU suite serves one so)
])
def test_a_served_adapter_in_float32_is_refused_on_a_gpu_only(dtype, served, on_gpu, refused):
    from batch_llm.engines.vllm_engine import served_lora_refusal

    why = served_lora_refusal(dtype, served=served, on_gpu=on_gpu)
    assert (why is not None) == refused
    if refused:  # says what to set instead
        assert "engine.dtype: bfloat16" in why and "model.lora.merge: true" in why
