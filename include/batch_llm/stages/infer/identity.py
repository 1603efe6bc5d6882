"""What changes a shard's outputs, in one place: the result cache's namespace hashes it, a shard's resume key holds it
(``shard_inputs``), and a shard folder made from other inputs starts over (``drop_stale_shard``). The reasoning parser
the engine gets is chosen here too (``auto`` from the model): it decides what ``output`` holds."""
from __future__ import annotations

import logging
from collections.abc import Callable

from batch_llm.config import PipelineConfig, SamplingConfig
from batch_llm.engines.base import EngineCannotRun
from batch_llm.host.probes import model_chat_template
from batch_llm.io.identity import ENGINE_FIELDS_NOT_IN_OUTPUT, OUTPUT_IDENTITY_FORMAT, engine_dtype
from batch_llm.io.storage import Location, exists, list_files, read_json, remove_tree, write_json
from batch_llm.manifests import ModelRef, ShardSpec
from batch_llm.reasoning import (
    ThinkingRefused,
    resolved_reasoning_parser,
    template_kwargs_problem,
    template_thinking,
    thinking_variables,
)


def chat_template_text(model_dir: str, override: str | None) -> str:
    """The chat template the tokenizer will use, read from the model's files (no tokenizer load)."""
    return override or model_chat_template(model_dir)


# sampling keys added after the cache's first namespaces: hashed only where set, so those namespaces stay the same
_LATER_SAMPLING_KEYS = ("top_k", "min_p", "repetition_penalty", "stop_token_ids", "include_stop_str_in_output",
                        "chat_template_kwargs", "thinking", "max_thinking_tokens")


def sampling_identity(s: SamplingConfig) -> dict:
    """The pipeline's sampling as the cache namespace hashes it: every field that decides an output; ``n`` and
    ``logprobs`` and ``guided_length_bounds`` only where set, so that namespaces from before they existed stay the
    same."""
    exclude = {"max_tokens_cap"} | ({"n"} if s.n == 1 else set()) | ({"logprobs"} if s.logprobs is None else set()) \
        | ({"guided_length_bounds"} if s.guided_length_bounds == "grammar" else set()) \
        | {k for k in _LATER_SAMPLING_KEYS if getattr(s, k) == type(s).model_fields[k].get_default(
            call_default_factory=True)}
    return s.model_dump(exclude=exclude)


def output_identity(cfg: PipelineConfig, *, model_key: str, model_dir: str) -> dict:
    """Everything shared by a run's rows that changes an output, in one place: the result cache's namespace is
    its hash (``result_cache.namespace``) and a shard's resume key holds it (``shard_inputs``), so a
    result is never reused across a change of any of it.

    The weights (``model_key``: id, revision, content hash, and the LoRA adapter's and the quantized export's
    names and hashes), whether the model's own code runs, the chat template's text, the sampling (the output
    schema and how it is decoded included; none for embed and classify, whose results it does not decide) and
    every engine setting but ``identity.ENGINE_FIELDS_NOT_IN_OUTPUT``: the engine, the task and its settings,
    dtype (as the engine will get it: ``auto`` on a CPU without native bfloat16 is float32), quantization,
    kv_cache_dtype, max_model_len (which rows fail as too long, and where a generation stops), speculative
    decoding (it changes a seeded sample's draws), engine.extra (anything) and the interpreter the engine runs
    in (its installation). The reasoning parser as the engine gets it (``auto`` chosen from the model), where there
    is one: it decides what ``output`` holds. What each row adds (its prompt, its own parameters) is the cache's
    row key."""
    e = cfg.engine
    engine = e.model_dump(mode="json", exclude=set(ENGINE_FIELDS_NOT_IN_OUTPUT))
    engine["dtype"] = engine_dtype(e.dtype, model_dir)
    engine["reasoning_parser"] = reasoning_parser(cfg, model_dir)
    if engine["reasoning_parser"] is None:  # no parser: the namespaces made before the key existed stay the same
        del engine["reasoning_parser"]
    for key in ("limit_mm_per_prompt", "mm_processor_kwargs"):  # images' settings: likewise, only where set
        if not engine.get(key):
            engine.pop(key, None)
    if e.precision == "model":  # the gate's keys only where it decides: earlier namespaces stay the same
        engine.pop("precision", None)
        engine.pop("precision_gate", None)
    return {"format": OUTPUT_IDENTITY_FORMAT, "model": model_key, "trust_remote_code": cfg.model.trust_remote_code,
            "chat_template": chat_template_text(model_dir, cfg.model.chat_template),
            "sampling": sampling_identity(cfg.sampling) if e.task == "generate" else {}, "engine": engine}


def reasoning_parser(cfg: PipelineConfig, model_dir: str) -> str | None:
    """``engine.reasoning_parser`` as the engine gets it: ``auto`` chosen from the model and its chat template
    (``reasoning.default_reasoning_parser``; none on an engine without one, or for a task that writes no text)."""
    return resolved_reasoning_parser(cfg.engine.reasoning_parser,
                                     serves_reasoning=cfg.engine.caps.reasoning and cfg.engine.task == "generate",
                                     model_dir=model_dir, template=chat_template_text(model_dir, cfg.model.chat_template))


def with_reasoning_parser(cfg: PipelineConfig, model_dir: str) -> PipelineConfig:
    """The config the engine starts with: ``engine.reasoning_parser`` as it gets it (``reasoning_parser``);
    EngineCannotRun where the pipeline's thinking settings cannot run on this model (``reasoning_problems``)."""
    if problems := reasoning_problems(cfg, model_dir):
        raise EngineCannotRun("; ".join(problems))
    parser = reasoning_parser(cfg, model_dir)
    if parser == cfg.engine.reasoning_parser:
        return cfg
    return cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"reasoning_parser": parser})})


def reasoning_problems(cfg: PipelineConfig, model_dir: str) -> list[str]:
    """What of the pipeline's thinking settings this model cannot do, named by key: ``sampling.thinking`` its
    template cannot honour, ``sampling.max_thinking_tokens`` without a reasoning parser for it. Checked when the
    model is fetched and again before its engine starts; a row's own settings are checked per row."""
    if cfg.engine.task != "generate":
        return []
    problems = []
    template = chat_template_text(model_dir, cfg.model.chat_template)
    try:
        thinking_variables(cfg.sampling.thinking, template_thinking(template))
    except ThinkingRefused as e:
        problems.append(f"sampling.{e}")
    where = "model.chat_template" if cfg.model.chat_template else f"the model's, at {model_dir}"
    if problem := template_kwargs_problem(cfg.sampling.chat_template_kwargs, template, where):
        problems.append(problem)
    if cfg.sampling.max_thinking_tokens is not None and reasoning_parser(cfg, model_dir) is None:
        problems.append(f"sampling.max_thinking_tokens: engine.reasoning_parser: {cfg.engine.reasoning_parser} found "
                        f"no reasoning parser for the model at {model_dir} (its chat template neither switches nor "
                        "opens a thinking block, or its family is not one auto knows); set engine.reasoning_parser "
                        "to vLLM's parser for it")
    return problems



def shard_inputs(cfg: PipelineConfig, ref: ModelRef, shard: ShardSpec) -> dict[str, str]:
    """What a shard's committed chunks are made from, part by part (short hashes): its plan and everything that
    changes an output (``output_identity``, which the result cache's namespace hashes too)."""
    from batch_llm.io.identity import identity_parts, stable_hash

    return {"plan": stable_hash([shard.plan_key, shard.index, shard.rows])[:16],
            **identity_parts(output_identity(cfg, model_key=ref.model_key, model_dir=ref.local_dir))}


def shard_input_key(cfg: PipelineConfig, ref: ModelRef, shard: ShardSpec) -> str:
    """One key for ``shard_inputs``: the same while the shard's committed chunks hold."""
    from batch_llm.io.identity import stable_hash

    return stable_hash(shard_inputs(cfg, ref, shard))


def drop_stale_shard(shard_dir: Location, inputs: dict[str, str], say: Callable[[str], None] = print) -> None:
    """Removes what the shard folder holds when it was made from other inputs (``shard_inputs``: the plan, the
    model, a setting that changes an output), saying which, then records the inputs it is now for (and why it
    started over) in ``inputs.json``. Chunks of the same inputs are kept: the shard resumes."""
    from batch_llm.io.identity import stable_hash, what_changed

    key = stable_hash(inputs)
    marker = shard_dir.child("inputs.json").path()
    before = read_json(marker) if exists(marker) else {}
    if before.get("key") == key:
        return
    record: dict = {"key": key, "parts": inputs}
    if list_files(shard_dir.path()):
        why = what_changed(before["parts"], inputs) if "parts" in before else "its inputs were not recorded by part"
        say(f"{shard_dir.url} was made from other inputs ({why}): starting it over")
        logging.getLogger("batch_llm.stages.infer").info("%s was made from other inputs (%s): starting it over",
                                                  shard_dir.url, why)
        remove_tree(shard_dir.path())
        record["started_over"] = why
    write_json(marker, record)
