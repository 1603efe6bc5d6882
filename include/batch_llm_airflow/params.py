"""Airflow Params: what a user may change per run in the trigger form, mapped onto config keys.

Defaults come from the pipeline's YAML file, so an untouched form runs the pipeline as configured.

Who may trigger a run may not thereby read any file of the worker: a local path in ``model_ref`` or
``filter_lists`` (plain, ``file://``, ``local://`` or behind a caching wrapper such as ``simplecache::``, resolved
by ``batch_llm.host.path_policy`` the way it will be opened) must lie under an allowed root (after ``~``, ``..`` and
symlinks are resolved), and a local word list must be a regular file within the policy's size limit. The roots:
what the pipeline's YAML names itself (its local model folder, its model cache, its local word-list files) and
the folders in ``$BATCH_LLM_ALLOWED_LOCAL_ROOTS`` or ``[batch_llm] allowed_local_roots`` (comma separated).
ModelScope ids, object-storage URLs and the shipped ``builtin:`` lists pass; any other URL is refused.
"""
from __future__ import annotations

import os
from typing import Any

from airflow.sdk import Param
from batch_llm.batch_api.runs import PARAM as BATCH_PARAM
from batch_llm.config import ConfigError, PipelineConfig
from batch_llm.config.capabilities import engine_kinds
from batch_llm.host import path_policy
from batch_llm.reasoning import THINKING_MODES

ALLOWED_ROOTS_ENV = "BATCH_LLM_ALLOWED_LOCAL_ROOTS"

# param name -> (dotted config key, JSON-schema type, description)
PARAM_KEYS: dict[str, tuple[str, Any, str]] = {
    "model_ref": ("model.ref", "string", "ModelScope id, local directory or object-storage prefix of the model"),
    "model_revision": ("model.revision", "string", "Model revision (ModelScope branch or tag)"),
    "engine": ("engine.kind", "string", "Inference engine"),  # the choices: the capability table's kinds
    "max_tokens": ("sampling.max_tokens", "integer", "Most tokens generated per row"),
    "temperature": ("sampling.temperature", "number", "Sampling temperature; 0 is greedy"),
    "top_p": ("sampling.top_p", "number", "Nucleus sampling probability mass"),
    "seed": ("sampling.seed", ["integer", "null"], "Sampling seed (fixed seed: reproducible, cacheable)"),
    "top_k": ("sampling.top_k", "integer", "Sample from the k most likely tokens; 0: off"),
    "min_p": ("sampling.min_p", "number", "Drop tokens below this share of the top token's probability; 0: off"),
    "repetition_penalty": ("sampling.repetition_penalty", "number", "Above 1 discourages repeated tokens; 1: off"),
    "stop_token_ids": ("sampling.stop_token_ids", "array", "Token ids that end an output (one per line)"),
    "include_stop_str_in_output": ("sampling.include_stop_str_in_output", "boolean",
                                   "Keep the stop string that ended an output"),
    "chat_template_kwargs": ("sampling.chat_template_kwargs", "object",
                             "Chat template variables, e.g. {\"enable_thinking\": false}"),
    "thinking": ("sampling.thinking", "string", "A reasoning model's thinking: auto (its chat template's default), on "
                 "or off"),
    "max_thinking_tokens": ("sampling.max_thinking_tokens", ["integer", "null"], "Thinking budget (vLLM): after this "
                            "many thinking tokens the answer follows; empty: none"),
    "rows_per_shard": ("sharding.rows_per_shard", ["integer", "null"], "Rows per inference task (or set num_shards)"),
    "num_shards": ("sharding.num_shards", ["integer", "null"], "Number of inference tasks (or set rows_per_shard)"),
    "filter_lists": ("filter.lists", "array", "Sensitive-word lists, one per line: ACTION NAME PATH "
                     "(action flag, mask or drop; path a file, s3://… or builtin:en / builtin:zh)"),
    "evaluate": ("evaluate.enabled", "boolean", "Score outputs with EvalScope when references exist"),
    "min_score": ("evaluate.min_score", ["number", "null"], "Fail the run below this score (evaluate.metric)"),
    "use_cache": ("cache.enabled", "boolean", "Reuse cached results for unchanged prompts"),
}


def _get(dumped: dict, dotted: str) -> Any:
    node: Any = dumped
    for part in dotted.split("."):
        node = node[part]
    return node


def params_for(cfg: PipelineConfig) -> dict[str, Param]:
    dumped = cfg.model_dump(mode="json")  # once: a config's size is paid once per DAG, not once per param
    out = {}
    for name, (key, typ, desc) in PARAM_KEYS.items():
        extra: dict[str, Any] = {}  # more JSON Schema keywords of the param
        if name == "engine":  # every kind of the capability table, read when the DAG is parsed (a dropdown)
            extra = {"enum": engine_kinds()}
        default = _get(dumped, key)
        if name == "filter_lists":  # the trigger form edits lists of strings well, lists of objects not at all
            default = [f"{wl['action']} {wl['name']} {wl['path']}" for wl in default]
            extra = {"items": {"type": "string"}}
        if name == "stop_token_ids":
            extra = {"items": {"type": "integer"}}
        if name == "thinking":
            extra = {"enum": list(THINKING_MODES)}
        out[name] = Param(default, type=typ, title=name.replace("_", " "), description=desc, **extra)
    if cfg.openai_batch is not None:  # set by POST /v1/batches (batch_llm_airflow.openai_app), empty otherwise
        out[BATCH_PARAM] = Param("", type="string", title="OpenAI batch id", description="The OpenAI Batch API "
                                 "batch this run serves (set by POST /v1/batches); empty: a run of the pipeline's "
                                 "own input")
    return out


def _word_list(item: Any) -> Any:
    """"mask en builtin:en" → {action, name, path}; anything else goes to validation as it is."""
    if isinstance(item, str) and len(item.split(maxsplit=2)) == 3:
        action, name, path = item.split(maxsplit=2)
        return {"action": action, "name": name, "path": path}
    return item


def overrides_from_params(params: dict, cfg: PipelineConfig) -> dict:
    """Dotted-key overrides from the run's params that differ from the form's defaults (``cfg``'s own values,
    ``params_for``): an untouched form changes nothing, and the config is not validated again.
    ``PipelineConfig.with_overrides`` applies them (of rows_per_shard and num_shards, the one changed wins)."""
    form = {k: p.value for k, p in params_for(cfg).items()}
    over = {PARAM_KEYS[k][0]: v for k, v in params.items() if k in PARAM_KEYS and v != form[k]}
    if isinstance(over.get("filter.lists"), list):
        over["filter.lists"] = [_word_list(item) for item in over["filter.lists"]]
    check_local_paths(over, cfg)
    return over


def _as_local(path: str) -> str:
    """The absolute path a local reference names, as the path policy resolves it (and storage opens it)."""
    return path_policy.local_path(path) or os.path.abspath(os.path.expanduser(path))


def local_model_path(ref: Any) -> str | None:
    """The local folder a model ref names; None for a ModelScope id or an object-storage prefix."""
    from batch_llm.host.path_policy import classify_ref

    if not isinstance(ref, str):
        return None
    try:
        kind = classify_ref(ref)
    except ValueError:  # neither: fetch refuses it with its own message
        return None
    return _as_local(ref) if kind == "local" else None


def local_word_list_path(item: Any) -> str | None:
    """The local file a word list names (through a caching wrapper too); None for ``builtin:`` and object
    storage."""
    path = item.get("path") if isinstance(item, dict) else None
    return path_policy.local_path(path) if isinstance(path, str) else None


def allowed_local_roots(cfg: PipelineConfig) -> list[str]:
    """The configured roots, then the local paths the pipeline's YAML names itself."""
    configured = os.environ.get(ALLOWED_ROOTS_ENV)
    if configured is None:
        from airflow.sdk.configuration import conf

        configured = conf.get("batch_llm", "allowed_local_roots", fallback="")
    roots = [_as_local(r.strip()) for r in configured.split(",") if r.strip()]
    own = [local_model_path(cfg.model.ref), cfg.model.resolved_cache_dir(),
           *(local_word_list_path(wl.model_dump()) for wl in cfg.filter.lists)]
    return roots + [_as_local(p) for p in own if p]


def _named_paths(over: dict) -> list[tuple[str, str]]:
    """(param, path) of every path the params name: the model ref and each word list's path."""
    named = [("model_ref", over["model.ref"])] if isinstance(over.get("model.ref"), str) else []
    lists = over.get("filter.lists")
    for item in lists if isinstance(lists, list) else []:
        path = item.get("path") if isinstance(item, dict) else None
        if isinstance(path, str):
            named.append(("filter_lists", path))
    return named


def check_local_paths(over: dict, cfg: PipelineConfig) -> None:
    """ConfigError when a path the params name is not one the path policy lets them name: a local path (plain,
    ``file://``, ``local://`` or wrapped: ``simplecache::file://``) outside the allowed roots, a local word list
    that is not a regular file within ``MAX_WORD_LIST_BYTES`` (a device, a FIFO), a ``builtin:`` other than a
    shipped list, or a URL that is neither local nor object storage (``http://``, ``zip::``, ...)."""
    from batch_llm.host.path_policy import classify_ref

    roots: list[str] | None = None
    for param, url in _named_paths(over):
        if param == "model_ref":
            try:
                if classify_ref(url) != "local":
                    continue  # a ModelScope id or an object-storage prefix
            except ValueError as e:
                raise ConfigError(f"params: {param}: {e}") from None
        resolved = path_policy.resolve(url)
        if resolved.kind == "builtin":
            try:
                path_policy.builtin_file(url)
            except path_policy.PathRefused as e:
                raise ConfigError(f"params: {param}: {e}") from None
            continue
        if resolved.kind == "storage":
            continue
        if resolved.kind != "local" or not resolved.local_path:
            raise ConfigError(f"params: {param} names {url!r}, which is neither a local path, an object-storage URL "
                              f"({', '.join(p + '://' for p in path_policy.OBJECT_STORAGE_PROTOCOLS)}) nor a "
                              f"built-in list ({', '.join(path_policy.builtin_names())})")
        path = resolved.local_path
        roots = allowed_local_roots(cfg) if roots is None else roots
        if not path_policy.under_roots(path, roots):
            raise ConfigError(
                f"params: {param} names the local path {path}, outside the folders a run's params may name "
                f"({', '.join(roots) or 'none'}); name a ModelScope id or an object-storage URL, or ask an admin "
                f"to add the folder to ${ALLOWED_ROOTS_ENV} or [batch_llm] allowed_local_roots")
        # a device, a FIFO or a huge file is refused here; a missing one is the filter stage's to report
        if param == "filter_lists" and os.path.lexists(path) and (
                problem := path_policy.local_file_problem(path, path_policy.MAX_WORD_LIST_BYTES)):
            raise ConfigError(f"params: {param}: word list {url!r}: {problem}")
