"""Airflow Params: what a user may change per run in the trigger form, mapped onto config keys.

Defaults come from the pipeline's YAML file, so an untouched form runs the pipeline as configured.
"""
from __future__ import annotations

from typing import Any

from airflow.sdk import Param
from batch_llm.config import PipelineConfig

# param name -> (dotted config key, JSON-schema type, description)
PARAM_KEYS: dict[str, tuple[str, Any, str]] = {
    "model_ref": ("model.ref", "string", "ModelScope id, local directory or object-storage prefix of the model"),
    "model_revision": ("model.revision", "string", "Model revision (ModelScope branch or tag)"),
    "engine": ("engine.kind", "string", "Inference engine: vllm, lmdeploy or transformers"),
    "max_tokens": ("sampling.max_tokens", "integer", "Most tokens generated per row"),
    "temperature": ("sampling.temperature", "number", "Sampling temperature; 0 is greedy"),
    "top_p": ("sampling.top_p", "number", "Nucleus sampling probability mass"),
    "seed": ("sampling.seed", ["integer", "null"], "Sampling seed (fixed seed: reproducible, cacheable)"),
    "rows_per_shard": ("sharding.rows_per_shard", ["integer", "null"], "Rows per inference task (or set num_shards)"),
    "num_shards": ("sharding.num_shards", ["integer", "null"], "Number of inference tasks (or set rows_per_shard)"),
    "filter_lists": ("filter.lists", "array", "Sensitive-word lists, one per line: ACTION NAME PATH "
                     "(action flag, mask or drop; path a file, s3://… or builtin:en / builtin:zh)"),
    "evaluate": ("evaluate.enabled", "boolean", "Score outputs with EvalScope when references exist"),
    "min_score": ("evaluate.min_score", ["number", "null"], "Fail the run below this score (evaluate.metric)"),
    "use_cache": ("cache.enabled", "boolean", "Reuse cached results for unchanged prompts"),
}
ENGINES = ["vllm", "lmdeploy", "transformers"]


def _get(cfg: PipelineConfig, dotted: str) -> Any:
    node: Any = cfg.model_dump(mode="json")
    for part in dotted.split("."):
        node = node[part]
    return node


def params_for(cfg: PipelineConfig) -> dict[str, Param]:
    out = {}
    for name, (key, typ, desc) in PARAM_KEYS.items():
        extra = {"enum": ENGINES} if name == "engine" else {}
        default = _get(cfg, key)
        if name == "filter_lists":  # the trigger form edits lists of strings well, lists of objects not at all
            default = [f"{wl['action']} {wl['name']} {wl['path']}" for wl in default]
            extra = {"items": {"type": "string"}}
        out[name] = Param(default, type=typ, title=name.replace("_", " "), description=desc, **extra)
    return out


def _word_list(item: Any) -> Any:
    """"mask en builtin:en" → {action, name, path}; anything else goes to validation as it is."""
    if isinstance(item, str) and len(item.split(maxsplit=2)) == 3:
        action, name, path = item.split(maxsplit=2)
        return {"action": action, "name": name, "path": path}
    return item


def overrides_from_params(params: dict, cfg: PipelineConfig) -> dict:
    """Dotted-key overrides from the run's params. rows_per_shard and num_shards exclude each other: the one
    the user changed from the pipeline's default wins."""
    over = {PARAM_KEYS[k][0]: v for k, v in params.items() if k in PARAM_KEYS}
    if isinstance(over.get("filter.lists"), list):
        over["filter.lists"] = [_word_list(item) for item in over["filter.lists"]]
    rps, ns = over.get("sharding.rows_per_shard"), over.get("sharding.num_shards")
    if rps and ns:
        if rps != cfg.sharding.rows_per_shard:
            over["sharding.num_shards"] = None
        else:
            over["sharding.rows_per_shard"] = None
    return over
