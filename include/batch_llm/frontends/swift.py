"""``batch-llm infer``: ms-swift's ``swift infer`` batch flags, mapped onto one pipeline configuration.

::

    batch-llm infer --model Qwen/Qwen2.5-7B-Instruct --infer_backend vllm --val_dataset rows.jsonl \\
        --max_new_tokens 512 --temperature 0 --vllm_max_model_len 8192 --result_path out.jsonl

The flags are spelled as ms-swift 4.x spells them (``swift/arguments/infer_args.py``, ``base_args/``,
``rlhf_trainers/args_mixin.py``'s ``VllmArguments``); ``FLAGS`` below says what each one becomes: a key of the
pipeline YAML (``config/``), a setting of this command, accepted without effect (a note or a warning), or refused
with the reason. A flag that is in no row is an error naming it. ``docs/ms-swift.md`` holds the same table
(``markdown_table()``; a unit test checks that they agree).

The command builds one ``PipelineConfig`` (one shard, no content filter, no scoring: ``swift infer`` does neither),
writes it as a pipeline YAML in the work folder (``batch-llm run`` takes that file as it is), runs the stages in this
process through ``batch-llm run``'s own function, and writes ``--result_path`` as ``swift infer`` does: one JSON line
per input row, in input order, appended to the file (swift's ``JsonlWriter`` appends too)::

    {"response": "...", "labels": null, "logprobs": null,
     "messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}

``response`` the completion, ``labels`` the row's trailing assistant message (removed from the prompt, as
``InferRequest.remove_response`` does) or its ``response`` column, ``logprobs`` OpenAI's chat ``logprobs`` object
(``--logprobs true``) or null, ``messages`` the prompt's messages with the completion appended; the row's other
standard keys of ms-swift (``label``, ``channel``, ``margin``) follow; its other columns are dropped, as swift's
loader drops them. A row that failed carries ``"response": null`` and ``"error"`` (swift has no such line: it stops).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from batch_llm.config import ConfigError, PipelineConfig, parse_config, require_engine_installed
from batch_llm.config.capabilities import engine_kinds
from batch_llm.frontends.written_config import keep_work_folder, run_written_config
from batch_llm.host import path_policy

PIPELINE_NAME = "swift_infer"
MAP, OWN, NOTE, WARN, REFUSE = "map", "own", "note", "warn", "refuse"


def _bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("true", "1", "yes", "on"):
        return True
    if low in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


def _json(text: str) -> dict:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {text!r}")
    return value


def _rope(text: str) -> dict:
    try:
        return _json(text)
    except ValueError:
        raise ValueError(f"{text!r}: a JSON object such as {{\"type\": \"yarn\", \"factor\": 4.0, "
                         f"\"original_max_position_embeddings\": 32768}} (swift's short form works its factor out "
                         f"of --max_model_len and the model's config.json; give the object it makes)") from None


def _optional_int(text: str) -> int | None:
    return None if text.strip().lower() in ("none", "null") else int(text)


@dataclass(frozen=True)
class SwiftFlag:
    """One flag of ``swift infer``: what ``batch-llm infer`` makes of it.

    ``action``: ``map`` (sets ``key`` of the pipeline YAML), ``own`` (a setting of this command: ``key`` names it),
    ``note`` (accepted, no effect here, a note is printed), ``warn`` (accepted, no effect here, a warning is
    printed: the outputs may differ from swift's), ``refuse`` (an error). ``neutral``: values that change nothing
    (a refused flag at one of them is accepted). ``backend``: the ``--infer_backend`` it belongs to (vllm,
    sglang, lmdeploy, transformers); with another backend it is ignored with a warning, as swift ignores it."""

    name: str
    action: str
    key: str | None = None
    type: Callable[[str], Any] = str
    how: str = ""
    backend: str | None = None
    many: bool = False
    neutral: tuple = ()


def _f(name, action, key=None, type=str, how="", backend=None, many=False, neutral=()):  # noqa: A002
    return SwiftFlag(name, action, key, type, how, backend, many, neutral)


_VLLM_ONLY = "vLLM engine argument"
FLAGS: tuple[SwiftFlag, ...] = (
    # ---- model and template (swift/arguments/base_args/model_args.py, template_args.py, base_args.py)
    _f("model", MAP, "model.ref", how="a local model folder or a ModelScope id (fetched into the model cache)"),
    _f("model_revision", MAP, "model.revision"),
    _f("model_type", NOTE, how="not needed: the model folder's config.json names the architecture"),
    _f("template", NOTE, how="not needed: prompts are rendered with the model's own chat template (swift's "
       "--template_backend jinja); a different template: model.chat_template"),
    _f("template_backend", NOTE, how="jinja is what batch-llm does; swift (ms-swift's default): a warning, the "
       "model's chat template is used all the same (outputs may differ where swift's template does)"),
    _f("use_chat_template", REFUSE, type=_bool, neutral=(True,), how="true only: rows are chats"),
    _f("system", MAP, "input.system_prompt", how="added to rows that have no system message"),
    _f("torch_dtype", MAP, "engine.dtype", how="bfloat16, float16, float32 (auto: the checkpoint's)"),
    _f("max_model_len", MAP, "engine.max_model_len", type=_optional_int),
    _f("adapters", MAP, "model.lora.ref", many=True, how="one LoRA adapter folder (a swift checkpoint: its "
       "args.json gives what --model and the others do not, as swift reads it; --load_args false: not read), "
       "merged into the model at fetch unless --merge_lora false"),
    _f("merge_lora", MAP, "model.lora.merge", type=_bool, how="true (the default here): the adapter merged into the "
       "model at fetch (cached by model and adapter), every engine runs it; false: vLLM serves it unmerged"),
    _f("load_args", OWN, type=_bool, how="false: the --adapters checkpoint's args.json is not read (true: as swift, "
       "it fills model, model_type, model_revision, torch_dtype, max_model_len, template, system)"),
    _f("max_length", WARN, type=_optional_int, how="prompts are not truncated: a prompt longer than "
       "engine.max_model_len is a row error"),
    _f("use_hf", REFUSE, type=_bool, neutral=(False,), how="models come from ModelScope or a local folder"),
    _f("attn_impl", NOTE, how="the engine picks its attention kernels"),
    _f("device_map", NOTE, how="the engine places the model (engine.tensor_parallel_size)"),
    _f("seed", MAP, "sampling.seed", type=int),
    _f("enable_thinking", MAP, "sampling.chat_template_kwargs.enable_thinking", type=_bool,
       how="the chat template's enable_thinking variable (Qwen3's and others'), as swift passes it"),
    # ---- data (base_args/data_args.py, infer_args.py)
    _f("val_dataset", OWN, "input.path", many=True, how="local .jsonl / .json files of swift rows (messages, or "
       "query / response / system / history), converted in input order; name#N takes the first N rows"),
    _f("val_dataset_sample", OWN, type=int, how="the first N rows (swift samples at random unless "
       "--dataset_shuffle false)"),
    _f("dataset", REFUSE, many=True, how="give the rows to infer as --val_dataset"),
    _f("split_dataset_ratio", REFUSE, type=float, how="give the rows to infer as --val_dataset"),
    _f("dataset_shuffle", NOTE, type=_bool, how="rows keep their input order"),
    _f("val_dataset_shuffle", NOTE, type=_bool, how="rows keep their input order"),
    _f("data_seed", NOTE, type=int, how="no sampling of rows"),
    _f("dataset_num_proc", NOTE, type=int, how="rows are converted in this process"),
    _f("load_from_cache_file", NOTE, type=_bool, how="no dataset cache"),
    _f("columns", REFUSE, how="rename the columns of the file (messages, or query / response)"),
    _f("streaming", REFUSE, type=_bool, neutral=(False,), how="the rows are read from local files"),
    # ---- generation (base_args/generation_args.py)
    _f("max_new_tokens", MAP, "sampling.max_tokens", type=int, how="not given: sampling.max_tokens's default "
       "(256); swift: up to the model length"),
    _f("temperature", MAP, "sampling.temperature", type=float, how="not given: 0 (greedy); swift: the model's "
       "generation_config.json"),
    _f("top_p", MAP, "sampling.top_p", type=float),
    _f("top_k", MAP, "sampling.top_k", type=int, how="-1 or 0: off (every engine applies it)"),
    _f("repetition_penalty", MAP, "sampling.repetition_penalty", type=float),
    _f("num_beams", REFUSE, type=int, neutral=(1,), how="no beam search"),
    _f("stop_words", MAP, "sampling.stop", many=True),
    _f("logprobs", MAP, "sampling.logprobs", type=_bool, how="true: sampling.logprobs = --top_logprobs or 0 "
       "(vLLM); the result's logprobs is OpenAI's chat logprobs object"),
    _f("top_logprobs", MAP, "sampling.logprobs", type=int, how="with --logprobs true"),
    _f("stream", NOTE, type=_bool, how="a batch: results are written when the run ends"),
    _f("structured_outputs_regex", REFUSE, how="sampling.output_schema (a JSON schema) instead"),
    # ---- inference (infer_args.py)
    _f("infer_backend", MAP, "engine.kind", how="vllm -> vllm, sglang -> sglang, lmdeploy -> lmdeploy, "
       "transformers / pt -> transformers"),
    _f("result_path", OWN, how="the result JSONL, appended to (as swift does)"),
    _f("max_batch_size", MAP, "engine.batch_size", type=int, backend="transformers", how="rows per batch of the "
       "transformers engine (-1: all rows)"),
    _f("write_batch_size", NOTE, type=int, how="results are written once, when the run ends"),
    _f("metric", WARN, how="not computed (batch-llm's scoring: evaluate.*, with references)"),
    # ---- vLLM (swift/rlhf_trainers/args_mixin.py VllmArguments)
    _f("vllm_gpu_memory_utilization", MAP, "engine.gpu_memory_utilization", type=float, backend="vllm"),
    _f("vllm_tensor_parallel_size", MAP, "engine.tensor_parallel_size", type=int, backend="vllm"),
    _f("vllm_max_model_len", MAP, "engine.max_model_len", type=_optional_int, backend="vllm"),
    _f("vllm_max_num_seqs", MAP, "engine.max_num_seqs", type=int, backend="vllm"),
    _f("vllm_enforce_eager", MAP, "engine.enforce_eager", type=_bool, backend="vllm"),
    _f("vllm_enable_prefix_caching", MAP, "engine.enable_prefix_caching", type=_bool, backend="vllm"),
    _f("vllm_quantization", MAP, "engine.quantization", backend="vllm"),
    _f("vllm_speculative_config", MAP, "engine.extra.speculative_config", type=_json, backend="vllm",
       how="JSON, passed to vLLM as is (n-gram only: engine.speculative)"),
    _f("vllm_engine_kwargs", MAP, "engine.extra", type=_json, backend="vllm", how="JSON: each key into "
       "engine.extra (passed to vLLM's LLM as is)"),
    _f("vllm_disable_custom_all_reduce", MAP, "engine.extra.disable_custom_all_reduce", type=_bool,
       backend="vllm", how=_VLLM_ONLY),
    _f("vllm_enable_expert_parallel", MAP, "engine.extra.enable_expert_parallel", type=_bool, backend="vllm",
       how=_VLLM_ONLY),
    _f("vllm_disable_cascade_attn", MAP, "engine.extra.disable_cascade_attn", type=_bool, backend="vllm",
       how=_VLLM_ONLY),
    _f("vllm_pipeline_parallel_size", REFUSE, type=int, neutral=(1,), backend="vllm",
       how="one model over several GPUs: --vllm_tensor_parallel_size"),
    _f("vllm_data_parallel_size", REFUSE, type=int, neutral=(1,), backend="vllm", how="data parallel runs are "
       "shards: the Airflow DAG runs them on several GPUs (sharding.num_shards)"),
    _f("vllm_use_async_engine", NOTE, type=_bool, backend="vllm", how="vLLM's offline LLM is used"),
    _f("vllm_max_lora_rank", REFUSE, type=int, neutral=(16,), backend="vllm", how="a served adapter's rank is read from "
       "its adapter_config.json"),
    _f("vllm_limit_mm_per_prompt", REFUSE, backend="vllm", how="text rows only"),
    _f("vllm_mm_processor_cache_gb", REFUSE, backend="vllm", how="text rows only"),
    _f("vllm_reasoning_parser", MAP, "engine.reasoning_parser", backend="vllm", how="vLLM's reasoning parser: "
       "response the answer, the assistant message's reasoning_content the thinking (unset: the whole output, as "
       "swift)"),
    # swift 3.x spellings (before the vllm_ prefix), which its 3.x example scripts use
    _f("gpu_memory_utilization", MAP, "engine.gpu_memory_utilization", type=float, backend="vllm",
       how="swift 3.x spelling of --vllm_gpu_memory_utilization"),
    _f("tensor_parallel_size", MAP, "engine.tensor_parallel_size", type=int, backend="vllm",
       how="swift 3.x spelling of --vllm_tensor_parallel_size"),
    _f("max_num_seqs", MAP, "engine.max_num_seqs", type=int, backend="vllm",
       how="swift 3.x spelling of --vllm_max_num_seqs"),
    _f("enforce_eager", MAP, "engine.enforce_eager", type=_bool, backend="vllm",
       how="swift 3.x spelling of --vllm_enforce_eager"),
    # ---- LMDeploy (infer_args.py LmdeployArguments)
    _f("lmdeploy_tp", MAP, "engine.tensor_parallel_size", type=int, backend="lmdeploy", how="LMDeploy's tp"),
    _f("lmdeploy_session_len", MAP, "engine.max_model_len", type=_optional_int, backend="lmdeploy",
       how="LMDeploy's session_len"),
    _f("lmdeploy_cache_max_entry_count", MAP, "engine.gpu_memory_utilization", type=float, backend="lmdeploy",
       how="LMDeploy's cache_max_entry_count"),
    _f("lmdeploy_quant_policy", MAP, "engine.kv_cache_dtype", type=int, backend="lmdeploy",
       how="0 -> auto, 4 -> int4, 8 -> int8 (LMDeploy's quant_policy)"),
    _f("lmdeploy_vision_batch_size", REFUSE, type=int, neutral=(1,), backend="lmdeploy", how="text rows only"),
    # ---- SGLang (infer_args.py SglangArguments); SGLang's own batch settings: engine.sglang in the pipeline YAML
    _f("sglang_tp_size", MAP, "engine.tensor_parallel_size", type=int, backend="sglang", how="SGLang's tp_size"),
    _f("sglang_mem_fraction_static", MAP, "engine.gpu_memory_utilization", type=float, backend="sglang",
       how="SGLang's mem_fraction_static (not given: 0.9, engine.gpu_memory_utilization's default; swift: SGLang's "
       "own estimate)"),
    _f("sglang_context_length", MAP, "engine.max_model_len", type=_optional_int, backend="sglang",
       how="SGLang's context_length"),
    _f("sglang_disable_cuda_graph", MAP, "engine.enforce_eager", type=_bool, backend="sglang",
       how="SGLang's disable_cuda_graph"),
    _f("sglang_quantization", MAP, "engine.quantization", backend="sglang"),
    _f("sglang_kv_cache_dtype", MAP, "engine.kv_cache_dtype", backend="sglang"),
    _f("sglang_ep_size", MAP, "engine.extra.ep_size", type=int, backend="sglang", how="SGLang engine argument "
       "(expert parallel size of a MoE model)"),
    _f("sglang_disable_custom_all_reduce", MAP, "engine.extra.disable_custom_all_reduce", type=_bool,
       backend="sglang", how="SGLang engine argument; not given: SGLang's own (custom all-reduce; swift passes true)"),
    _f("sglang_speculative_algorithm", MAP, "engine.extra.speculative_algorithm", backend="sglang",
       how="SGLang engine argument, passed as is (EAGLE needs its draft model in engine.extra; unmeasured here)"),
    _f("sglang_speculative_num_steps", MAP, "engine.extra.speculative_num_steps", type=_optional_int,
       backend="sglang", how="SGLang engine argument"),
    _f("sglang_speculative_eagle_topk", MAP, "engine.extra.speculative_eagle_topk", type=_optional_int,
       backend="sglang", how="SGLang engine argument"),
    _f("sglang_speculative_num_draft_tokens", MAP, "engine.extra.speculative_num_draft_tokens", type=_optional_int,
       backend="sglang", how="SGLang engine argument"),
    _f("sglang_pp_size", REFUSE, type=int, neutral=(1,), backend="sglang",
       how="one model over several GPUs: --sglang_tp_size"),
    _f("sglang_dp_size", REFUSE, type=int, neutral=(1,), backend="sglang", how="data parallel runs are shards: the "
       "Airflow DAG runs them on several GPUs (sharding.num_shards)"),
    _f("sglang_enable_dp_attention", REFUSE, type=_bool, neutral=(False,), backend="sglang",
       how="data parallel attention needs --sglang_dp_size equal to --sglang_tp_size; data parallel runs are shards"),
    _f("sglang_enable_ep_moe", REFUSE, type=_bool, neutral=(False,), backend="sglang",
       how="removed from SGLang (0.5.17 has no such argument): --sglang_ep_size"),
    # ---- the rest of ms-swift 4.6's InferArguments (swift_fields.py lists them all): what each is in swift and
    # what becomes of it here
    # ModelArguments
    _f("task_type", REFUSE, neutral=("causal_lm",), how="swift's embedding / seq_cls / reranker / decision inference "
       "writes other result lines; batch-llm run with engine.task: embed or classify"),
    _f("experts_impl", NOTE, how="transformers' MoE expert kernels: the engine picks its own"),
    _f("new_special_tokens", REFUSE, many=True, how="tokens added to the tokenizer for training; an adapter "
       "trained with new tokens: merge it into the model (swift export --merge_lora true) and give that as --model"),
    _f("num_labels", REFUSE, type=_optional_int, neutral=(None,), how="a classification head (--task_type "
       "seq_cls); batch-llm run with engine.task: classify"),
    _f("problem_type", REFUSE, how="a classification head (--task_type seq_cls); batch-llm run with "
       "engine.task: classify"),
    _f("rope_scaling", MAP, "engine.extra.hf_overrides.rope_scaling", type=_rope, how="a JSON object (type, "
       "factor, original_max_position_embeddings) laid over the model's config.json through vLLM's hf_overrides "
       "(vllm backend only); swift's short form (linear / dynamic / yarn, its factor from --max_model_len) is "
       "refused: give the object"),
    _f("max_memory", NOTE, how="the engine places the model (engine.gpu_memory_utilization)"),
    _f("local_repo_path", REFUSE, how="the GitHub code some models load (deepseek-vl2); batch-llm runs models "
       "that vLLM or transformers run from their own folder"),
    _f("init_strategy", REFUSE, how="initialises weights the checkpoint lacks (a custom architecture); a "
       "checkpoint missing weights is refused by the engine here"),
    # TemplateArguments
    _f("truncation_strategy", REFUSE, neutral=("delete",), how="delete (swift's default) is what batch-llm does: "
       "a prompt longer than engine.max_model_len is the row's error line, never cut; left / right / split cut "
       "what the model reads: shorten the rows or raise --vllm_max_model_len"),
    _f("max_pixels", MAP, "engine.mm_processor_kwargs.max_pixels", type=int, how="the image processor's "
       "max_pixels (Qwen2-VL and others), as swift sets MAX_PIXELS"),
    _f("agent_template", REFUSE, how="tool-calling prompts: rows with tools are refused (text rows only)"),
    _f("norm_bbox", NOTE, how="grounding boxes of swift's multimodal templates: prompts use the model's own chat "
       "template"),
    _f("padding_side", NOTE, how="the engine batches without padding"),
    _f("padding_free", NOTE, type=_bool, how="a training setting (packed batches)"),
    _f("loss_scale", NOTE, how="a training setting (loss weights): inference computes no loss"),
    _f("sequence_parallel_size", REFUSE, type=int, neutral=(1,), how="training's sequence parallelism; one model "
       "over several GPUs: --vllm_tensor_parallel_size"),
    _f("is_binary_loss_scale", NOTE, type=_bool, how="a training setting (loss weights)"),
    _f("response_prefix", REFUSE, how="swift writes it after the assistant header so that every response "
       "continues it (e.g. '<think>\\n'); batch-llm has no assistant prefix: prompts end with the chat template's "
       "generation prompt (thinking on or off: --enable_thinking)"),
    _f("preserve_thinking", NOTE, type=_bool, how="earlier turns' thinking is what the model's chat template keeps "
       "(swift's template option)"),
    _f("add_non_thinking_prefix", NOTE, type=_bool, how="a training setting (the empty thinking block of "
       "non-thinking rows); at inference: --enable_thinking"),
    _f("disable_ignore_empty_think", NOTE, type=_bool, how="a training setting (loss of empty thinking blocks)"),
    # DataArguments
    _f("cached_dataset", REFUSE, many=True, how="swift's pre-tokenized datasets (swift export "
       "--to_cached_dataset); give the rows as --val_dataset .jsonl"),
    _f("cached_val_dataset", REFUSE, many=True, how="swift's pre-tokenized datasets (swift export "
       "--to_cached_dataset); give the rows as --val_dataset .jsonl"),
    _f("interleave_prob", REFUSE, many=True, type=float, how="mixes the datasets at random; --val_dataset files "
       "are read one after the other, in order"),
    _f("stopping_strategy", NOTE, how="of --interleave_prob only: files are read one after the other"),
    _f("shuffle_buffer_size", NOTE, type=int, how="of --streaming only: rows keep their input order"),
    _f("download_mode", NOTE, how="no hub datasets: --val_dataset reads local files"),
    _f("strict", NOTE, type=_bool, how="rows are read strictly: a row of another shape stops the command, naming "
       "it (swift without --strict drops it)"),
    _f("remove_unused_columns", NOTE, type=_bool, how="other columns are dropped from the result lines, as swift "
       "drops them"),
    _f("disable_auto_column_mapping", NOTE, type=_bool, how="columns are messages, or query / response / system / "
       "history, by those names"),
    _f("model_name", NOTE, many=True, how="self-cognition training data: inference does not use it"),
    _f("model_author", NOTE, many=True, how="self-cognition training data: inference does not use it"),
    _f("custom_dataset_info", REFUSE, many=True, how="registers datasets by name for swift's loader; give local "
       "files as --val_dataset"),
    _f("decision_drop_instructions", NOTE, type=float, how="training augmentation of --task_type decision rows"),
    _f("decision_subsample_options", NOTE, type=int, how="training augmentation of --task_type decision rows"),
    _f("decision_state_as_text", NOTE, type=float, how="training augmentation of --task_type decision rows"),
    _f("decision_shuffle_fields", NOTE, type=_bool, how="training augmentation of --task_type decision rows"),
    # QuantizeArguments (swift quantizes at load; here the quantize stage exports once, cached)
    _f("quant_method", MAP, "quantize.scheme", how="bnb / hqq / eetq / quanto with --quant_bits 4: the quantize "
       "stage's W4A16 (round-to-nearest, llm-compressor, cached), fp8: its FP8_DYNAMIC; swift quantizes at load "
       "with that library, so outputs differ slightly; 8-bit integer weights and 1-3 bits are refused (4 or fp8)"),
    _f("quant_bits", MAP, "quantize.scheme", how="with --quant_method: 4 -> W4A16, float8 -> FP8_DYNAMIC"),
    _f("hqq_axis", NOTE, type=int, how="an HQQ setting: the quantize stage's W4A16 groups weights "
       "(quantize.group_size in a pipeline YAML)"),
    _f("bnb_4bit_compute_dtype", NOTE, how="a bitsandbytes setting: the engine computes in --torch_dtype"),
    _f("bnb_4bit_quant_type", NOTE, how="a bitsandbytes setting (nf4 / fp4): the quantize stage makes int4 groups"),
    _f("bnb_4bit_use_double_quant", NOTE, type=_bool, how="a bitsandbytes setting: the quantize stage makes int4 "
       "groups"),
    _f("bnb_4bit_quant_storage", NOTE, how="a bitsandbytes setting: the quantize stage makes int4 groups"),
    # BaseArguments
    _f("tuner_backend", NOTE, how="LoRA adapters are merged by peft at fetch or served by vLLM"),
    _f("tuner_type", REFUSE, neutral=("lora", "full"), how="adapters of another tuner (adalora, vera, boft, reft, "
       "...) are not read: merge it into the model (swift export --merge_lora true) and give that as --model"),
    _f("external_plugins", REFUSE, many=True, how="Python files that register swift's models, templates and "
       "datasets; batch-llm runs no plugin code: the model folder's config.json and chat template"),
    _f("custom_register_path", REFUSE, many=True, how="swift 3.x spelling of --external_plugins: batch-llm runs no "
       "plugin code"),
    _f("model_kwargs", MAP, "engine.mm_processor_kwargs", type=_json, how="swift sets each key as an environment "
       "variable its model code reads; MAX_PIXELS, MIN_PIXELS: the image processor's max_pixels, min_pixels "
       "(engine.mm_processor_kwargs); another key is refused (no engine here reads swift's variables)"),
    _f("enable_npu_model_patch", NOTE, type=_bool, how="Ascend NPU patches: the engines here run on GPUs or CPUs"),
    _f("load_data_args", REFUSE, type=_bool, neutral=(False,), how="reads the training's validation split from the "
       "checkpoint's args.json; give those rows as --val_dataset"),
    _f("packing", NOTE, type=_bool, how="a training setting (packed sequences)"),
    _f("packing_length", NOTE, type=_optional_int, how="a training setting (packed sequences)"),
    _f("packing_num_proc", NOTE, type=int, how="a training setting (packed sequences)"),
    _f("packing_strategy", NOTE, how="a training setting (packed sequences)"),
    _f("lazy_tokenize", NOTE, type=_bool, how="the engine tokenizes each prompt"),
    _f("hub_token", REFUSE, how="a token on the command line; the model fetch reads MODELSCOPE_API_TOKEN from the "
       "environment"),
    _f("ddp_timeout", NOTE, type=int, how="no torch.distributed run: shards are separate processes"),
    _f("ddp_backend", NOTE, how="no torch.distributed run: shards are separate processes"),
    _f("ignore_args_error", NOTE, type=_bool, how="an unknown flag is always an error here"),
    _f("use_swift_lora", REFUSE, type=_bool, neutral=(False,), how="swift's own LoRA format; peft adapters "
       "(adapter_config.json) only"),
    # RayArguments
    _f("use_ray", REFUSE, type=_bool, neutral=(False,), how="swift's Ray runs; several GPUs run shards of one "
       "pipeline as Airflow tasks (sharding.num_shards)"),
    _f("ray_exp_name", NOTE, how="of --use_ray only"),
    _f("device_groups", REFUSE, how="Ray device groups (--use_ray); the engine's GPUs: "
       "--vllm_tensor_parallel_size"),
    # MergeArguments (--merge_lora's output)
    _f("safe_serialization", NOTE, type=_bool, how="the merged model is written as safetensors in the model cache"),
    _f("max_shard_size", NOTE, how="the merged model's files are written by peft in the model cache"),
    # InferArguments
    _f("reranker_use_activation", NOTE, type=_bool, how="of --task_type reranker only (refused)"),
    # swift 2.x / 3.0 spelling, which ms-swift 4 no longer takes
    _f("ckpt_dir", MAP, "model.lora.ref", how="swift 2.x / 3.0 spelling: a folder with adapter_config.json is "
       "--adapters, another one --model"),
    # ---- batch-llm's own options (spelled with '-')
)
BY_NAME = {f.name: f for f in FLAGS}
# swift's backend names that are this project's engine kinds, and swift 3.x's "pt" for the transformers engine
BACKENDS = {**{kind: kind for kind in engine_kinds()}, "pt": "transformers"}
KV_POLICY = {0: "auto", 4: "int4", 8: "int8"}
#: ms-swift's standard row keys that a result line carries over (RowPreprocessor.standard_keys, text only).
PASSED_KEYS = ("label", "channel", "margin")
#: Standard keys of media, tools and preference pairs: a row with one of them set is refused.
REFUSED_KEYS = ("images", "videos", "audios", "tools", "objects", "rejected_response", "rejected_messages",
                "rejected_images", "positive_messages", "negative_messages")


# ------------------------------------------------------------------------------------------ parsing
@dataclass
class SwiftInvocation:
    """The parsed words of a ``swift infer`` command line: each flag's typed value, and batch-llm's own options."""

    values: dict[str, Any]
    work_dir: str | None = None
    plain: bool = False
    verbose: bool = False
    print_config: bool = False
    help: bool = False


OWN_OPTIONS = {"--work-dir": "a folder for the run (kept: its report, its pipeline.yaml, the result cache; default: "
                             "a temporary folder, removed at the end)",
               "--plain": "plain progress lines even on a terminal",
               "--verbose": "the engine libraries' logs on the terminal (-v)",
               "--print-config": "print the pipeline YAML the flags make, and stop"}


def parse_swift_args(words: Sequence[str]) -> SwiftInvocation:
    """Parses ``--flag value`` / ``--flag=value`` words as swift does (a bare boolean flag is true; a list flag takes
    every word up to the next flag). An unknown flag, a missing or malformed value: ConfigError naming the flag."""
    inv = SwiftInvocation(values={})
    words = list(words)
    i = 0
    while i < len(words):
        i = _own_option(inv, words, i) or _swift_flag(inv, words, i)
    return inv


_SWITCHES = {"-h": "help", "--help": "help", "-v": "verbose", "--verbose": "verbose", "--plain": "plain",
             "--print-config": "print_config"}


def _own_option(inv: SwiftInvocation, words: list[str], i: int) -> int | None:
    """The index after batch-llm's own option at ``words[i]``; None where it is not one."""
    w = words[i]
    if w in _SWITCHES:
        setattr(inv, _SWITCHES[w], True)
        return i + 1
    if w.startswith("--work-dir="):
        inv.work_dir = w.split("=", 1)[1]
        return i + 1
    if w == "--work-dir":
        if i + 1 >= len(words):
            raise ConfigError("--work-dir: expected a folder")
        inv.work_dir = words[i + 1]
        return i + 2
    return None


def _swift_flag(inv: SwiftInvocation, words: list[str], i: int) -> int:
    """Reads the swift flag at ``words[i]`` and its values into ``inv.values``; the index after them."""
    w = words[i]
    i += 1
    if not w.startswith("--"):
        raise ConfigError(f"{w!r}: expected a --flag (swift infer's flags are --name value)")
    name, eq, inline = w[2:].partition("=")
    name = name.replace("-", "_")
    flag = BY_NAME.get(name)
    if flag is None:
        raise ConfigError(f"--{name}: not a flag batch-llm infer knows (its swift flags: docs/ms-swift.md; "
                          f"anything else: write a pipeline YAML and use batch-llm run)")
    raw: list[str] = [inline] if eq else []
    while not eq and i < len(words) and not (words[i].startswith("--") or words[i] in _SWITCHES):
        raw.append(words[i])
        i += 1
    if not raw and flag.type is _bool:
        raw = ["true"]
    if not raw:
        raise ConfigError(f"--{name}: expected a value")
    if len(raw) > 1 and not flag.many:
        raise ConfigError(f"--{name}: expected one value, got {len(raw)}: {' '.join(raw)}")
    try:
        vals = [flag.type(r) for r in raw]
    except ValueError as e:  # json.JSONDecodeError is a ValueError
        raise ConfigError(f"--{name}: {e}") from None
    if flag.many:
        inv.values.setdefault(name, []).extend(vals)
    else:
        inv.values[name] = vals[0]
    return i


# ------------------------------------------------------------------------------------------ the config
@dataclass
class InferPlan:
    """What the flags make: the pipeline config's overrides, the notes and warnings, the result path."""

    overrides: dict[str, Any]
    notes: list[str]
    warnings: list[str]
    backend: str
    datasets: list[str]
    sample: int | None
    result_path: str


def plan_invocation(inv: SwiftInvocation) -> InferPlan:
    """The dotted YAML keys the flags set, and what is said about the others. ConfigError for a refused flag, a
    missing --model / --val_dataset / --result_path, or an unknown backend."""
    v = inv.values
    notes: list[str] = []
    if "ckpt_dir" in v:
        notes.append(_ckpt_dir(v))
    notes += checkpoint_args(v)
    for required in ("model", "val_dataset"):
        if required not in v:
            raise ConfigError(f"--{required}: required (batch-llm infer runs a dataset through a model: "
                              f"--model DIR_OR_ID --val_dataset rows.jsonl --result_path out.jsonl; or --adapters "
                              f"CHECKPOINT whose args.json names the model)")
    raw_backend = str(v.get("infer_backend", "transformers"))
    if raw_backend not in BACKENDS:
        raise ConfigError(f"--infer_backend {raw_backend}: batch-llm runs vllm, sglang, lmdeploy or transformers "
                          f"(pt); no {raw_backend} engine")
    backend = BACKENDS[raw_backend]
    over: dict[str, Any] = {"engine.kind": backend}
    warnings: list[str] = []
    for name, value in v.items():
        _judge(BY_NAME[name], value, v, raw_backend, backend, over, notes, warnings)
    if "result_path" not in v:
        raise ConfigError("--result_path: required (swift's default, a timestamped file under result/, is not "
                          "made here): --result_path out.jsonl")
    return InferPlan(over, notes, warnings, backend, list(v["val_dataset"]), v.get("val_dataset_sample"),
                     os.path.abspath(os.path.expanduser(v["result_path"])))


def _ckpt_dir(values: dict[str, Any]) -> str:
    """swift 2.x's --ckpt_dir as ms-swift 4 spells it: --adapters for a LoRA checkpoint (adapter_config.json in
    it), --model for a full one. Returns the note saying which."""
    ckpt = values.pop("ckpt_dir")
    is_adapter = (Path(os.path.expanduser(ckpt)) / "adapter_config.json").is_file()
    name = "adapters" if is_adapter else "model"
    if values.get(name):
        raise ConfigError(f"--ckpt_dir {ckpt}: a {'LoRA' if is_adapter else 'full'} checkpoint, and --{name} is "
                          f"given too: give one of them")
    values[name] = [ckpt] if is_adapter else ckpt
    return f"--ckpt_dir: read as --{name} {ckpt} (ms-swift 4's spelling)"


def _judge(flag: SwiftFlag, value: Any, values: dict[str, Any], raw_backend: str, backend: str,
           over: dict[str, Any], notes: list[str], warnings: list[str]) -> None:
    """What one flag does: a key set in ``over``, a note, a warning, or ConfigError (refused)."""
    name = flag.name
    if flag.backend and flag.backend != backend:
        warnings.append(f"--{name}: ignored: it is an option of the {flag.backend} backend and --infer_backend "
                        f"is {raw_backend} (swift ignores it too)")
    elif flag.action == REFUSE:
        if not (value in flag.neutral or (flag.many and not value)):
            raise ConfigError(f"--{name} {_shown(value)}: not supported by batch-llm infer: {flag.how}")
    elif name == "template_backend" and value == "swift":
        warnings.append("--template_backend swift: batch-llm renders prompts with the model's own chat template "
                        "(swift's jinja backend); outputs may differ where swift's template does")
    elif flag.action == NOTE:
        notes.append(f"--{name}: no effect here: {flag.how}")
    elif flag.action == WARN:
        warnings.append(f"--{name} {_shown(value)}: no effect here: {flag.how}")
    elif flag.action == MAP and name != "infer_backend":
        _map(flag, value, values, over)


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return " ".join(map(str, value))
    return json.dumps(value) if isinstance(value, dict) else str(value)


def _map(flag: SwiftFlag, value: Any, values: dict[str, Any], over: dict[str, Any]) -> None:
    name, key = flag.name, flag.key
    assert key is not None
    if name in ("adapters", "merge_lora"):
        _map_adapter(values, over)
        return
    if name in ("quant_method", "quant_bits", "rope_scaling", "model_kwargs"):
        _map_model_settings(name, value, values, over)
        return
    if name == "model":
        value = os.path.abspath(os.path.expanduser(value)) if os.path.exists(os.path.expanduser(value)) else value
    elif name == "logprobs":
        if not value:
            return
        value = values.get("top_logprobs") or 0
    elif name == "top_logprobs" and not values.get("logprobs"):
        raise ConfigError("--top_logprobs: needs --logprobs true (as in swift)")
    elif name == "max_batch_size" and value <= 0:
        return  # -1: no limit; set from the row count once the rows are read (InferRun)
    elif name == "lmdeploy_quant_policy":
        if value not in KV_POLICY:
            raise ConfigError(f"--lmdeploy_quant_policy {value}: 0, 4 or 8")
        value = KV_POLICY[value]
    elif name == "vllm_engine_kwargs":
        for k, x in value.items():
            over[f"engine.extra.{k}"] = x
        return
    over[key] = value


#: The --model_kwargs environment variables that are an image processor's settings (swift's qwen-vl loaders read
#: them) and their names in vLLM's mm_processor_kwargs.
MODEL_KWARGS_PIXELS = {"MAX_PIXELS": "max_pixels", "MIN_PIXELS": "min_pixels"}
#: swift's load-time quantization (--quant_method, --quant_bits) -> the quantize stage's scheme.
QUANT_SCHEMES = {("bnb", "4"): "W4A16", ("hqq", "4"): "W4A16", ("eetq", "4"): "W4A16", ("quanto", "4"): "W4A16",
                 ("fp8", None): "FP8_DYNAMIC", ("fp8", "float8"): "FP8_DYNAMIC", ("quanto", "float8"): "FP8_DYNAMIC"}


def _map_model_settings(name: str, value: Any, values: dict[str, Any], over: dict[str, Any]) -> None:
    """--quant_method / --quant_bits, --rope_scaling and --model_kwargs: what swift changes in the model it loads."""
    if name in ("quant_method", "quant_bits"):
        _map_quant(values, over)
    elif name == "rope_scaling":
        if over["engine.kind"] != "vllm":
            raise ConfigError(f"--rope_scaling: laid over the model's config through vLLM's hf_overrides; the "
                              f"{over['engine.kind']} engine takes none: --infer_backend vllm")
        over["engine.extra.hf_overrides.rope_scaling"] = value
    else:
        for k, x in value.items():
            if k.upper() not in MODEL_KWARGS_PIXELS:
                raise ConfigError(f"--model_kwargs {k}: swift sets it as the environment variable {k.upper()} that "
                                  f"its model code reads; no engine here reads it (MAX_PIXELS and MIN_PIXELS are "
                                  f"the image processor's: engine.mm_processor_kwargs)")
            over[f"engine.mm_processor_kwargs.{MODEL_KWARGS_PIXELS[k.upper()]}"] = int(x)


def _map_quant(values: dict[str, Any], over: dict[str, Any]) -> None:
    """--quant_method and --quant_bits: the quantize stage (an export once, cached by model and scheme) in place of
    swift's quantization at load."""
    method, bits = values.get("quant_method"), values.get("quant_bits")
    if method is None:
        raise ConfigError(f"--quant_bits {bits}: needs --quant_method (bnb, hqq, eetq, quanto or fp8), as in swift")
    scheme = QUANT_SCHEMES.get((method, None if bits is None else str(bits)))
    if scheme is None:
        raise ConfigError(f"--quant_method {method} --quant_bits {bits}: batch-llm's quantize stage makes int4 "
                          f"weights (--quant_bits 4) or FP8 (--quant_method fp8); swift's {bits or 'default'}-bit "
                          f"{method} at load has no counterpart here")
    over["quantize.enabled"] = True
    over["quantize.scheme"] = scheme
    if scheme == "W4A16":  # data-free, as swift's load-time int4 is
        over["quantize.method"] = "rtn"


#: The keys of a swift checkpoint's args.json that ``swift infer --adapters CKPT`` fills where the command line leaves
#: them unset (ms-swift's BaseArguments.load_args_from_ckpt, load_keys) and that are flags here. swift does not load
#: the training's max_length for inference (and --max_length has no effect here: prompts are not truncated).
CHECKPOINT_KEYS = ("model", "model_type", "model_revision", "torch_dtype", "max_model_len", "template", "system")


def checkpoint_args(values: dict[str, Any]) -> list[str]:
    """Fills ``values`` from the args.json of the first --adapters folder (then --model) that has one, as swift
    does: only the ``CHECKPOINT_KEYS`` the command line left unset; --load_args false reads none. Returns the note
    saying what was read."""
    if not values.get("load_args", True):
        return []
    folders = [*values.get("adapters", []), *([values["model"]] if "model" in values else [])]
    ckpt = next((Path(os.path.expanduser(f)) for f in folders
                 if (Path(os.path.expanduser(f)) / "args.json").is_file()), None)
    if ckpt is None:
        return []
    path = ckpt / "args.json"
    try:
        trained = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: not readable as JSON ({e}); --load_args false skips it") from None
    if not isinstance(trained, dict):
        raise ConfigError(f"{path}: expected a JSON object of swift's arguments")
    read = []
    for key in CHECKPOINT_KEYS:
        old = trained.get(key)
        if old is None or values.get(key) not in (None, []):
            continue
        try:  # as the flag's own value would be
            values[key] = BY_NAME[key].type(old) if isinstance(old, str) else old
        except ValueError as e:
            raise ConfigError(f"{path}: {key}: {e}") from None
        read.append(f"--{key} {_shown(values[key])}")
    return [f"{path}: {', '.join(read)} (the training's, as swift reads them)"] if read else []


def _map_adapter(values: dict[str, Any], over: dict[str, Any]) -> None:
    """--adapters and --merge_lora: one model.lora."""
    adapters = values.get("adapters")
    if not adapters:
        raise ConfigError("--merge_lora: needs --adapters (the LoRA checkpoint to merge)")
    if len(adapters) != 1:
        raise ConfigError(f"--adapters {_shown(adapters)}: one adapter (it is merged into the model at fetch)")
    ref = adapters[0]
    over["model.lora"] = {"ref": os.path.abspath(ref) if os.path.exists(ref) else ref,
                          "merge": values.get("merge_lora", True)}


def base_config(work_dir: Path) -> dict[str, Any]:
    """The pipeline every ``batch-llm infer`` starts from: one shard, no content filter (swift filters nothing), no
    scoring, its output under the work folder."""
    return {"name": PIPELINE_NAME, "description": "batch-llm infer (ms-swift's swift infer flags)",
            "model": {"ref": "unset"}, "input": {"path": str(work_dir / "rows.jsonl"), "format": "jsonl",
                                                  "sampling_columns": ["chat_template_kwargs"]},
            "sharding": {"num_shards": 1}, "filter": {"enabled": False}, "evaluate": {"enabled": False},
            "engine": {"reasoning_parser": None},  # swift parts no thinking unless --vllm_reasoning_parser asks
            "output": {"path": str(work_dir / "output")}}


def build_config(plan: InferPlan, work_dir: Path) -> PipelineConfig:
    """One typed PipelineConfig: the base pipeline with the flags' keys set, validated by the config model (its
    errors name the key; the flag that set it is in ``FLAGS``)."""
    cfg = parse_config(base_config(work_dir), "batch-llm infer")
    return cfg.with_overrides(plan.overrides, source="batch-llm infer (swift flags)")


# ------------------------------------------------------------------------------------------ rows
def read_swift_rows(datasets: Sequence[str], sample: int | None) -> list[dict]:
    """The rows of the --val_dataset files, in order (``file#N``: its first N rows; then --val_dataset_sample)."""
    rows: list[dict] = []
    for spec in datasets:
        path, _, count = spec.partition("#")
        p = Path(os.path.expanduser(path))
        if not p.is_file():
            raise ConfigError(f"--val_dataset {spec}: no such file (batch-llm infer reads local .jsonl / .json files; "
                              f"download a hub dataset first)")
        text = p.read_text(encoding="utf-8")
        if p.suffix == ".json":
            try:
                got = json.loads(text)
            except json.JSONDecodeError as e:
                raise ConfigError(f"--val_dataset {spec}: not valid JSON: {e}") from None
            if not isinstance(got, list):
                raise ConfigError(f"--val_dataset {spec}: a .json file holds a list of rows")
            file_rows = [(i + 1, r) for i, r in enumerate(got)]
        else:
            file_rows = []
            for n, line in enumerate(text.splitlines(), 1):
                if line.strip():
                    try:
                        file_rows.append((n, json.loads(line)))
                    except json.JSONDecodeError as e:
                        raise ConfigError(f"{p}: line {n}: not valid JSON: {e}") from None
        if count:
            file_rows = file_rows[:int(count)]
        for n, r in file_rows:
            if not isinstance(r, dict):
                raise ConfigError(f"{p}: line {n}: a row is a JSON object")
            rows.append({"_where": f"{p}: line {n}", **r})
    return rows[:sample] if sample is not None else rows


def split_row(row: dict) -> tuple[list[dict], Any, dict]:
    """(prompt messages, labels, the standard keys passed on) of one swift row: ``messages`` (a trailing assistant
    message is the label, as swift's remove_response takes it), or ``query`` with ``system``, ``history`` (pairs)
    and ``response`` (the label). ConfigError for a row of another shape, or one with media or tools."""
    where = row.get("_where", "a row")
    for k in REFUSED_KEYS:
        if row.get(k):
            raise ConfigError(f"{where}: {k!r}: text rows only (no media, tools or preference pairs)")
    if isinstance(row.get("messages"), list):
        messages = [dict(m) for m in row["messages"]]
        labels = messages.pop()["content"] if messages and isinstance(messages[-1], dict) and \
            messages[-1].get("role") == "assistant" else None
    elif isinstance(row.get("query"), str):
        messages = [{"role": "system", "content": row["system"]}] if row.get("system") else []
        for pair in row.get("history") or []:
            if not (isinstance(pair, (list, tuple)) and len(pair) == 2):
                raise ConfigError(f"{where}: 'history': a list of [query, response] pairs")
            messages += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
        messages.append({"role": "user", "content": row["query"]})
        labels = row.get("response")
    else:
        raise ConfigError(f"{where}: a row needs 'messages' (a list of {{role, content}}) or 'query'")
    if not messages:
        raise ConfigError(f"{where}: no prompt: its only message is the assistant's")
    return messages, labels, {k: row[k] for k in PASSED_KEYS if k in row}


def row_id(i: int) -> str:
    return f"r{i:09d}"


def input_rows(rows: Sequence[dict]) -> list[dict]:
    """The pipeline's input: each row's prompt under an id of its position, and its own chat template variables
    (swift's ``chat_template_kwargs`` row key, laid over --enable_thinking as swift does)."""
    return [{"id": row_id(i), "messages": split_row(r)[0],
             **({"chat_template_kwargs": r["chat_template_kwargs"]} if r.get("chat_template_kwargs") else {})}
            for i, r in enumerate(rows)]


def result_lines(rows: Sequence[dict], outputs: dict[str, dict], errors: dict[str, str]) -> list[dict]:
    """swift infer's result lines, one per input row in input order, from the published rows (by id) and the run's
    errors (id -> reason)."""
    lines = []
    for i, row in enumerate(rows):
        messages, labels, passed = split_row(row)
        out = outputs.get(row_id(i))
        if out is not None and out.get("error") is None and isinstance(out.get("output"), str):
            response = out["output"]
            thinking = {"reasoning_content": out["reasoning"]} if "reasoning" in out else {}
            lines.append({"response": response, "labels": labels, "logprobs": swift_logprobs(out.get("logprobs")),
                          "messages": [*messages, {"role": "assistant", "content": response, **thinking}], **passed})
        else:
            reason = (out or {}).get("error") or errors.get(row_id(i)) or "no output published for this row"
            lines.append({"response": None, "labels": labels, "logprobs": None, "messages": messages, **passed,
                          "error": reason})
    return lines


def swift_logprobs(tokens: list[dict] | None) -> dict | None:
    """A row's token log-probabilities (``stages.infer.results``: token, logprob, top) as swift's engines return them
    (``InferEngine._get_logprobs``): ``{"content": [{token, logprob, bytes, top_logprobs}]}``, ``top_logprobs`` only
    where candidates were asked for (--top_logprobs)."""
    if tokens is None:
        return None

    def entry(t: dict) -> dict:
        return {"token": t["token"], "logprob": t["logprob"], "bytes": list(t["token"].encode("utf-8"))}

    return {"content": [{**entry(t), **({"top_logprobs": [entry(c) for c in t["top"]]} if t.get("top") else {})}
                        for t in tokens]}


def published_rows(cfg: PipelineConfig, ds: str) -> tuple[dict[str, dict], dict[str, str]]:
    """The published rows of the run of ``ds`` (by id) and its error file (id -> reason)."""
    from batch_llm.io.storage import Location, iter_jsonl, read_json
    from batch_llm.stages.publish import published_lines

    part = Location(cfg.output.path).child(cfg.name, cfg.output.partition.format(ds=ds))
    current = read_json(part.child("_CURRENT.json").path())
    summary = read_json(Location(current["version"]).child("summary.json").path())
    outputs = {str(r["id"]): r for r in published_lines(summary["dataset"])}
    errors = {str(e.get("id")): str(e.get("reason")) for e in iter_jsonl(Location(summary["errors"]).path())}
    return outputs, errors


def append_jsonl(path: str, lines: Sequence[dict]) -> None:
    """Appends the lines (swift's JsonlWriter appends to an existing file; ensure_ascii off, as swift writes)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines))


# ------------------------------------------------------------------------------------------ the command
def add_infer_parser(sub, commands: dict, run: Callable[[argparse.Namespace], int]) -> None:
    """Registers ``batch-llm infer`` on cli.py's subparsers: every word after ``infer`` goes to
    ``parse_swift_args`` (swift's flags, not argparse's), and ``commands["infer"]`` runs it through ``run``
    (cli.py's cmd_run; passed in, so this module does not import cli)."""
    sp = sub.add_parser("infer", help="ms-swift's `swift infer` batch flags (--model, --infer_backend, --val_dataset, "
                        "--result_path, --vllm_* ...): the pipeline on them, swift's result JSONL (docs/ms-swift.md)",
                        prefix_chars="+", add_help=False)
    sp.add_argument("swift_args", nargs="*", metavar="SWIFT_FLAGS")
    commands["infer"] = lambda args: cmd_infer(args, run)


def usage() -> str:
    own = "\n".join(f"  {k:<16} {v}" for k, v in OWN_OPTIONS.items())
    return ("usage: batch-llm infer --model DIR_OR_ID --val_dataset ROWS.jsonl --result_path OUT.jsonl "
            "[--infer_backend vllm|sglang|lmdeploy|pt] [swift flags ...]\n\nms-swift's `swift infer` flags; what each one "
            f"becomes: docs/ms-swift.md.\n\nbatch-llm's own options:\n{own}\n\nswift flags:\n"
            + "\n".join(f"  --{f.name:<32} {f.key or f.action}" for f in FLAGS))


def cmd_infer(args: argparse.Namespace, run: Callable[[argparse.Namespace], int]) -> int:
    inv = parse_swift_args(args.swift_args)
    if inv.help:
        print(usage())
        return 0
    plan = plan_invocation(inv)
    if not inv.print_config:  # before any row is read: the engine this would start must be here
        require_engine_installed(plan.backend, plan.overrides.get("engine.python"), chosen_by="--infer_backend")
    # before any work: a run whose results could not be written is lost
    if not inv.print_config and (problem := path_policy.output_file_problem(
            plan.result_path, tuple(d.partition("#")[0] for d in plan.datasets))):
        raise ConfigError(f"--result_path {problem}")
    rows = read_swift_rows(plan.datasets, plan.sample)
    if not rows:
        raise ConfigError(f"--val_dataset {' '.join(plan.datasets)}: no rows")
    pipeline_in = input_rows(rows)  # ConfigError on a row of another shape, before any engine starts
    if inv.values.get("max_batch_size", 1) <= 0 and plan.backend == "transformers":
        plan.overrides["engine.batch_size"] = len(rows)
    keep = inv.work_dir is not None
    if not keep:  # the result cache would live in a folder deleted at the end: writing it is work thrown away
        plan.overrides.setdefault("cache.enabled", False)
    work = Path(os.path.abspath(os.path.expanduser(inv.work_dir))) if inv.work_dir is not None else \
        Path(tempfile.mkdtemp(prefix="batch-llm-infer-"))
    started = finished = False
    try:
        work.mkdir(parents=True, exist_ok=True)
        cfg = build_config(plan, work)
        config_path = work / "pipeline.yaml"
        config_path.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False, allow_unicode=True))
        for n in plan.notes:
            print(f"note: {n}", file=sys.stderr)
        for w in plan.warnings:
            print(f"warning: {w}", file=sys.stderr)
        if inv.print_config:
            print(config_path.read_text(), end="")
            return 0
        with open(work / "rows.jsonl", "w", encoding="utf-8") as f:
            f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in pipeline_in))
        started = True
        rc, ds = run_written_config(config_path, run, args, run_prefix="infer", plain=inv.plain, verbose=inv.verbose)
        if rc != 0:
            return rc
        outputs, errors = published_rows(cfg, ds)
        lines = result_lines(rows, outputs, errors)
        append_jsonl(plan.result_path, lines)
        failed = sum(1 for x in lines if x["response"] is None)
        print(f"result: {plan.result_path} ({len(lines)} lines appended, {failed} without a response)")
        if keep:
            print(f"  pipeline: {config_path} (batch-llm run {shlex.quote(str(config_path))})")
        finished = True
        return 0
    finally:
        keep_work_folder(work, keep=keep, started=started, finished=finished)


# ------------------------------------------------------------------------------------------ the docs table
ACTION_WORDS = {MAP: "", OWN: "batch-llm infer", NOTE: "no effect (note)", WARN: "no effect (warning)",
                REFUSE: "refused"}


def markdown_table() -> str:
    """The flag table of docs/ms-swift.md (between its swift-flags markers), made from ``FLAGS``."""
    lines = ["| swift flag | pipeline YAML key | backend | notes |", "| --- | --- | --- | --- |"]
    for f in FLAGS:
        key = f"`{f.key}`" if f.key and f.action in (MAP, OWN) else ACTION_WORDS[f.action]
        if f.action == OWN and f.key:
            key += " (batch-llm infer)"
        neutral = f" (accepted at {', '.join(_shown(x) for x in f.neutral)})" if f.neutral else ""
        how = (f.how + neutral).replace("|", "\\|")
        lines.append(f"| `--{f.name}` | {key} | {f.backend or 'all'} | {how} |")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m batch_llm.frontends.swift: the table of docs/ms-swift.md
    print(markdown_table())
