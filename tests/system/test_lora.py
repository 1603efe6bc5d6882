"""LoRA adapters on the CPU (model.lora): served by vLLM (merge: false) and merged at fetch (merge: true) give the
same greedy outputs, and they differ from the base model's.

The adapter is made here, offline, with peft on the demo model: rank 8 on the attention projections, lora_B
set to seeded random values (peft starts it at zero, which would change nothing). The base is the demo model in
float32, and every engine runs float32: a merged bf16 folder rounds W + BA once where a served adapter adds BA
to bf16 W, and a near tie in greedy decoding may then go either way; in float32 the two agree to ~1e-6.

One vLLM engine start: the served run. The base and merged runs use the transformers engine (the merged folder
is a plain model: every engine loads it), with the same pipeline code (``stages``).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from batch_llm import api
from batch_llm.io.storage import iter_jsonl
from batch_llm.layout import RunLayout
from helpers import demo_config

PROMPTS = ["What is the capital of France?", "Name three colors.", "Write one sentence about the sea.",
           "What is 2 + 2?", "Say hello in German."]


@pytest.fixture(scope="module")
def base_and_adapter(tmp_path_factory, demo_model_dir) -> tuple[Path, Path]:
    import shutil

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("lora")
    base = root / "base-fp32"
    shutil.copytree(demo_model_dir, base, ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
    model = AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32)
    model.save_pretrained(base)
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM",
                                                  target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    adapter = root / "adapter"
    peft_model.save_pretrained(adapter)
    return base, adapter


def _run(tmp: Path, base: Path, run: str, **over) -> tuple[dict[str, str], object, dict]:
    inp = tmp / "prompts.jsonl"
    inp.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n" for i, p in enumerate(PROMPTS)))
    cfg = demo_config(tmp / run, model__ref=str(base), model__cache_dir=str(tmp / "model-cache"),
                      input__path=str(inp), sharding__num_shards=1,
                      sampling__max_tokens=16, engine__dtype="float32", cache__enabled=False, **over)
    layout = RunLayout.for_run(cfg, run_id=run, ds="2026-12-01")
    fetched = api.fetch(cfg, layout)
    model = api.quantize(cfg, layout, fetched)
    plan = api.plan_shards(cfg, layout)
    shard = api.infer_shard(cfg, layout, model, plan.shards[0], say=lambda _: None)
    rows = {r["id"]: r["output"] for r in iter_jsonl(Path(shard.outputs))}
    assert len(rows) == len(PROMPTS) and all(isinstance(v, str) for v in rows.values()), rows
    return rows, fetched, shard.engine.settings


def test_served_and_merged_agree_and_differ_from_base(tmp_path, base_and_adapter):
    base, adapter = base_and_adapter
    lora = {"ref": str(adapter)}
    served, served_fetch, served_engine = _run(tmp_path, base, "served", model__lora={**lora, "merge": False})
    merged, merged_fetch, _ = _run(tmp_path, base, "merged", model__lora={**lora, "merge": True},
                                   engine__kind="transformers")
    plain, plain_fetch, _ = _run(tmp_path, base, "base", engine__kind="transformers")
    assert served_engine["lora"] == {"path": str(adapter), "max_lora_rank": 8}  # vLLM served it, as the shard says

    assert served == merged, {k: (served[k], merged[k]) for k in served if served[k] != merged[k]}
    differ = [k for k in plain if plain[k] != merged[k]]
    assert len(differ) >= 3, (plain, merged)

    # What the manifests say: served keeps the model folder and hands the adapter on; merged points at a new
    # folder; the three model keys differ (the result cache must never mix them)
    assert served_fetch.adapter.mode == "serve" and served_fetch.ref().lora_dir == str(adapter)
    assert served_fetch.local_dir == plain_fetch.local_dir == str(base)
    assert merged_fetch.adapter.mode == "merge" and merged_fetch.ref().lora_dir is None
    assert merged_fetch.local_dir != str(base) and merged_fetch.adapter.base_dir == str(base)
    assert len({served_fetch.model_key, merged_fetch.model_key, plain_fetch.model_key}) == 3

    # A second fetch of the same pair is a cache hit of the merge: same folder, no work
    cfg = demo_config(tmp_path / "again", model__ref=str(base), model__cache_dir=str(tmp_path / "model-cache"),
                      model__lora={**lora, "merge": True})
    again = api.fetch(cfg, RunLayout.for_run(cfg, run_id="again", ds="2026-12-01"))
    assert again.adapter.merge_cache_hit is True and again.local_dir == merged_fetch.local_dir
