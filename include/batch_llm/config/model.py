"""The one configuration model: a pipeline's YAML file, Airflow Params and CLI flags all fill these objects.

Every stage takes the section it needs (``ModelConfig`` for fetch, ``EngineConfig`` + ``SamplingConfig`` for
inference, ...), so a value set in the YAML file reaches the engine unchanged. Validation errors name the
file and the dotted key::

    pipelines/daily.yaml: engine.gpu_memory_utilization: Input should be less than or equal to 1
    pipelines/daily.yaml: sampling.max_token: unknown key 'max_token' in section 'sampling'; did you mean 'max_tokens'?
"""
from __future__ import annotations

import difflib
import os
import re
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from batch_llm.config.capabilities import (
    DEFAULT_KIND,
    ENGINES,
    EXTRA_SAMPLING_KEYS,
    EngineCapabilities,
    capabilities,
    engines_serving,
    missing_package,
    takes_no_images,
    who_can,
)
from batch_llm.config.precision import Precision, PrecisionGateConfig
from batch_llm.config.sglang import SglangSettings
from batch_llm.host import path_policy
from batch_llm.reasoning import SWITCH_VARIABLES


class ConfigError(ValueError):
    """A pipeline configuration that cannot be used; the message names the file and the key."""


class EngineNotInstalled(ConfigError):
    """The engine a command would start here is not installed here (``require_engine_installed``)."""


def require_engine_installed(kind: str, python: str | None = None, *, chosen_by: str = "engine.kind") -> None:
    """Refuses, before any work, an engine whose package this interpreter lacks, naming the extra and
    ``engine.python``. Not a check of config loading: a scheduler or a DAG parser loads configs of engines that
    run on other machines; the commands that start the engine in this process tree call it (``chosen_by``: the
    key or flag that chose the kind, as the message names it)."""
    if problem := missing_package(kind, python):
        raise EngineNotInstalled(f"{chosen_by} {kind}: {problem}")


class _Section(BaseModel):
    # Unknown keys are errors: a typo in a YAML file must not be silently ignored.
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class LoraConfig(_Section):
    """A LoRA adapter on the model, fetched like it: ``ref`` is a ModelScope id, a local folder or an
    object-storage prefix holding ``adapter_config.json`` and ``adapter_model.safetensors`` (or ``.bin``).

    ``merge: true`` merges it into a new model folder (cached by model and adapter content), which every later
    stage and engine uses as the model (quantize included); ``merge: false`` serves it unmerged (vLLM only:
    ``enable_lora`` and a ``LoRARequest`` on every request)."""

    ref: str
    revision: str = "master"
    merge: bool = Field(True, description="true: merge into the model at fetch; false: the engine serves the "
                        "adapter (vllm only)")
    conn_id: str | None = Field(None, description="Airflow connection for an object-storage ref")


class ModelConfig(_Section):
    """Which model to run, and where it comes from.

    ``ref`` is a ModelScope id (``Qwen/Qwen2.5-7B-Instruct``), a local directory, or an object-storage
    prefix (``s3://bucket/models/qwen``). ModelScope downloads land in ``cache_dir``; a cache hit makes no
    network call.
    """

    ref: str
    revision: str = "master"
    cache_dir: str | None = Field(None, description="ModelScope cache; default $BATCH_LLM_MODEL_CACHE")
    trust_remote_code: bool = Field(False, description="Run model code shipped with the checkpoint")
    chat_template: str | None = Field(None, description="Jinja chat template overriding the tokenizer's")
    require_chat_template: bool = Field(True, description="The fetch stage refuses a model without a chat template "
                                        "(chat rows need one) unless chat_template is set; false where every input "
                                        "row is pre-tokenized (prompt_token_ids): fetch then only warns")
    conn_id: str | None = Field(None, description="Airflow connection for an object-storage ref")
    lora: LoraConfig | None = Field(None, description="A LoRA adapter on the model; null: none")

    def resolved_cache_dir(self) -> str:
        if self.cache_dir:
            return os.path.expanduser(self.cache_dir)
        from batch_llm.demo_model import default_cache_dir

        return str(default_cache_dir())


class QuantizeConfig(_Section):
    """Optional export with llm-compressor into a compressed-tensors checkpoint, cached by model, revision,
    scheme and settings.

    ``W4A16``: int4 weights in groups, 16-bit activations (AWQ or round-to-nearest; ``method``, ``group_size``
    and the calibration settings apply). ``FP8_DYNAMIC``: FP8 (e4m3) weights with one scale per output
    channel and activations quantized per token at run time; it needs no calibration data, so ``method``,
    ``group_size`` and the calibration settings do not apply and setting them is an error. FP8 pays on GPUs
    with FP8 tensor cores (Hopper, Ada: 1.22x on the H200, docs/benchmarks.md); vLLM's CPU build runs it
    through a slow fallback.
    """

    enabled: bool = False
    scheme: Literal["W4A16", "FP8_DYNAMIC"] = "W4A16"
    method: Literal["awq", "rtn"] = Field("awq", description="W4A16 only. awq: activation-aware; "
                                          "rtn: round-to-nearest")
    group_size: int | None = Field(None, gt=0, description="Weights per quantization group; null: the largest "
                                   "of 128, 64, 32 dividing the model's hidden size (from its config.json)")
    calibration_samples: int = Field(64, gt=0)
    calibration_seq_len: int = Field(256, gt=0)
    awq_grid: int = Field(20, gt=0, description="AWQ scale search grid; smaller is faster")
    cache_dir: str | None = Field(None, description="default: <model cache>/quantized")
    python: str | None = Field(None, description="Interpreter of the quantize environment "
                               "(default $BATCH_LLM_QUANTIZE_PYTHON or .venv-quantize/bin/python)")

    @model_validator(mode="after")
    def _w4a16_settings_only_with_w4a16(self) -> "QuantizeConfig":
        if self.scheme != "W4A16":
            # a setting that would silently do nothing is refused, like an unknown key
            given = sorted(self.model_fields_set & {"method", "group_size", "calibration_samples",
                                                    "calibration_seq_len", "awq_grid"})
            if given:
                raise ValueError(f"quantize.{', quantize.'.join(given)}: W4A16 settings; scheme {self.scheme} "
                                 "is data-free per-channel FP8 and takes none of them (remove them)")
        return self


Format = Literal["auto", "jsonl", "parquet", "csv", "openai_batch"]
# The table columns that may carry a row's own sampling (row_params reads them)
SamplingColumn = Literal["max_tokens", "temperature", "top_p", "stop", "seed", "presence_penalty", "frequency_penalty",
                         "n", "logprobs", "top_k", "min_p", "repetition_penalty", "stop_token_ids",
                         "include_stop_str_in_output", "chat_template_kwargs", "thinking", "reasoning_effort",
                         "max_thinking_tokens"]


# input.max_line_bytes' default: a line past it is the line's error, read in bounded memory (io/formats.py)
MAX_LINE_BYTES = 64 * 2**20


def _only_max_tokens() -> list[SamplingColumn]:
    return ["max_tokens"]


class InputConfig(_Section):
    """Where the prompts are and how a row becomes a chat.

    A row has an id and either chat ``messages``, a ``prompt`` string, or columns rendered by ``template``
    (``"Translate to French: {text}"``). ``path`` may contain ``{ds}`` (the run's date, YYYY-MM-DD) for
    daily partitions: ``s3://lake/prompts/dt={ds}/``.
    """

    path: str
    format: Format = "auto"
    conn_id: str | None = None
    id_column: str = "id"
    messages_column: str = "messages"
    prompt_column: str = "prompt"
    template: str | None = None
    system_prompt: str | None = None
    reference_column: str = Field("reference", description="Reference answers for scoring, when present")
    sampling_columns: list[SamplingColumn] = Field(
        default_factory=_only_max_tokens,
        description="Columns whose value, where a row has one, overrides the sampling section for that row "
                    "(OpenAI Batch input reads these from each request body)")
    image_columns: list[str] = Field(
        default_factory=list, description="Columns holding a row's images (JSONL, CSV, Parquet): a path or URL "
        "(data:, s3:// through conn_id, a local path under the input's folder or image_roots), a list of them (a "
        "JSON list in CSV), or the image's bytes (a Parquet binary column, or a {bytes, path} struct as Hugging Face "
        "datasets write). They go before the text of the row's user message. Chat rows may name images in their "
        "own content parts (image_url) instead. Needs an engine that takes images (vllm)")
    max_image_bytes: int = Field(20 * 2**20, gt=0, description="The largest image a row may name, in bytes "
                                 "(default 20 MiB, OpenAI's limit); a larger one is the row's error")
    max_image_pixels: int = Field(40_000_000, gt=0, description="The most pixels (width × height, read from the "
                                  "image's header before anything is decoded) an image may have: a larger one is the "
                                  "row's error, so a small file of huge dimensions (a decompression bomb) never takes "
                                  "their memory. Default 40 MP (160 MB decoded); vision-language models resize to far "
                                  "fewer (Qwen2-VL: 12.8 MP)")
    image_workers: int = Field(4, ge=1, le=64, description="Threads that read, check and decode a shard's images "
                               "ahead of the engine, in the rows' order, at most 2 × this many requests ahead, each "
                               "holding its images decoded (and at most max_decoded_bytes_ahead of them), and that "
                               "check the planner's images in object storage ahead of its rows (reads overlap); 1: "
                               "each image on its row's turn")
    max_decoded_bytes_ahead: int = Field(1 << 30, gt=0, description="The most memory the images loaded ahead of the "
                                         "engine may take decoded (4 bytes a pixel, from their headers): a request "
                                         "that would go past it starts loading once those before it have gone to "
                                         "the engine (one alone always loads). Default 1 GiB")
    image_roots: list[str] = Field(default_factory=list, description="Local folders a row's image paths may point "
                                   "into besides the input's own folder (./relative to this YAML); a path outside "
                                   "them is the row's error")
    max_line_bytes: int = Field(MAX_LINE_BYTES, gt=0, description="The longest input line read, in bytes (JSONL and "
                                "OpenAI Batch lines; CSV lines, in characters): a longer line is that line's error, "
                                "skipped without being held in memory. Default 64 MiB: a million-token prompt is "
                                "~4 MB of text, an inline image at input.max_image_bytes ~27 MiB of base64. Parquet is "
                                "read a record batch at a time, its values as the file stores them (not bounded "
                                "here)")

    @field_validator("image_columns")
    @classmethod
    def _distinct_image_columns(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v) or any(not c for c in v):
            raise ValueError(f"name each image column once, none empty: {v}")
        return v

    @field_validator("path")
    @classmethod
    def _fillable_path(cls, v: str) -> str:
        # RunLayout fills it with str.format: an unknown placeholder is refused here, not a traceback at run time
        if problem := path_policy.template_problem(v):
            raise ValueError(problem)
        return v


class ShardingConfig(_Section):
    """How the valid rows are split into shards (one inference task each)."""

    rows_per_shard: int | None = Field(None, gt=0)
    num_shards: int | None = Field(None, gt=0)
    sort_by_length: bool = Field(True, description="Inside a shard, rows with the largest output budget first, "
                                   "then by prompt length (plan.shard_order); false: input order")
    shards_per_task: int = Field(1, ge=1, description="Consecutive shards one inference task runs in turn on "
                                 "one engine (one worker, one GPU lease): the engine starts once per task, not once "
                                 "per shard. Each shard keeps its own folder, chunk commits, manifest and "
                                 "exactly-once resume; the mapped task count is ceil(shards / shards_per_task). "
                                 "Not part of the plan: changing it does not re-plan or redo committed shards")
    # With neither set, shards are sized so that engine start stays under max_engine_start_share of a shard's
    # time, from these two expectations (defaults: measured on one H200, Qwen2.5-7B shape; docs/benchmarks.md).
    max_engine_start_share: float = Field(0.1, gt=0, lt=1)
    expected_engine_start_seconds: float = Field(70.0, gt=0)
    expected_output_tokens_per_second: float = Field(15000.0, gt=0)

    @model_validator(mode="after")
    def _one_of(self) -> "ShardingConfig":
        if self.rows_per_shard and self.num_shards:
            raise ValueError("set rows_per_shard or num_shards, not both")
        return self

    @staticmethod
    def size_changes(current: Mapping[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
        """``changes`` to the two sizes (rows_per_shard, num_shards: overrides by field name) against ``current``
        (a sharding section's values): they exclude each other, so a size changed from the current one wins and
        unsets the other, unless that one is changed too (then both stay, and ``_one_of`` refuses them). The
        trigger form, which shows both with the pipeline's values, and a command line that sets one both come
        through here (``apply_overrides``)."""
        changed = [k for k in SHARD_SIZES if changes.get(k) is not None and changes[k] != current.get(k)]
        if len(changed) != 1:
            return dict(changes)
        return {**changes, **{k: None for k in SHARD_SIZES if k != changed[0]}}


SHARD_SIZES = ("rows_per_shard", "num_shards")  # the two ways to size shards; ShardingConfig.size_changes


class MemoryBackoffConfig(_Section):
    """Retries an engine start that fails for memory with smaller settings, within these bounds."""

    enabled: bool = True
    max_attempts: int = Field(4, ge=1)
    gpu_memory_utilization_step: float = Field(0.05, gt=0, lt=0.5)
    min_gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    min_max_num_seqs: int = Field(8, ge=1)
    min_max_model_len: int = Field(512, ge=16)
    probe: bool = Field(False, description="vLLM: size max_num_seqs from the KV cache the engine got (the most "
                        "sequences of max_model_len tokens that fit), less safety_margin; one extra engine start")
    safety_margin: float = Field(0.12, ge=0, lt=0.5, description="ms-swift guidance: 10-15 %")
    probe_max_num_seqs: int = Field(1024, ge=1, description="the probe never goes above this")


class SpeculativeConfig(_Section):
    """vLLM's n-gram speculative decoding (prompt lookup): the next tokens are drafted by matching the last
    ``prompt_lookup_min``..``prompt_lookup_max`` tokens against the prompt and the output so far, and the model
    checks ``num_speculative_tokens`` drafts in one step. It pays where outputs repeat their input (extraction,
    rewriting) at small batches; measured on the H200 in docs/benchmarks.md. vLLM's proposer needs ``numba``."""

    method: Literal["ngram"] = "ngram"
    num_speculative_tokens: int = Field(4, ge=1, le=16, description="Drafted tokens checked per step")
    prompt_lookup_max: int = Field(4, ge=1, le=16, description="Longest n-gram matched")
    prompt_lookup_min: int = Field(2, ge=1, le=16, description="Shortest n-gram matched")

    @model_validator(mode="after")
    def _min_within_max(self) -> "SpeculativeConfig":
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) is above prompt_lookup_max "
                             f"({self.prompt_lookup_max})")
        return self

    def vllm_kwargs(self) -> dict:
        """What ``LLM(speculative_config=...)`` receives (vLLM 0.26's SpeculativeConfig fields)."""
        return self.model_dump()


class EmbedConfig(_Section):
    """Settings of ``engine.task: embed`` (vLLM's pooling runner; PoolingParams of vLLM 0.32)."""

    normalize: bool = Field(True, description="L2-normalize every vector (vLLM's use_activation for embed)")


class ClassifyConfig(_Section):
    """Settings of ``engine.task: classify`` (vLLM's pooling runner, its classify pooler: the last token's
    class logits, softmaxed)."""

    labels: list[str] | None = Field(None, min_length=2, description="The classes. Given: a causal LM becomes a "
                                     "zero-shot classifier whose score for a label is the logit of that label's "
                                     "token at the prompt's last position (vLLM's classifier_from_token), so each "
                                     "label must be one token of the model's vocabulary (checked at engine start) "
                                     "and the prompt should ask for one of them. null: the model's own "
                                     "classification head (a *ForSequenceClassification checkpoint), its classes "
                                     "from config.json's id2label")

    @field_validator("labels")
    @classmethod
    def _distinct(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and len(set(v)) != len(v):
            raise ValueError(f"labels must be distinct: {v}")
        return v


# Keys of the engine section only some engines honor: (key, the capability that honors it, what it is). Set (not
# at its default) for an engine whose row lacks the capability, the key is refused naming the engines that have it.
_ENGINE_ONLY_KEYS = (
    ("speculative", "speculative", "n-gram speculative decoding is a vLLM option (its speculative_config)"),
    ("multiprocessing", "engine_core_process", "vLLM's engine-core process"),
    ("torch_compile", "torch_compile", "vLLM's compilation mode"),
    ("compile_cache", "compile_cache", "vLLM's compilation cache"),
    ("tensor_parallel_size", "tensor_parallel", "the model split over that many GPUs"),
    ("limit_mm_per_prompt", "images", "images per prompt, of an engine that takes images"),
    ("mm_processor_kwargs", "images", "the image processor's settings, of an engine that takes images"),
)


class EngineConfig(_Section):
    """The engine and its parameters; ``kind`` picks a row of the engine capability table
    (``config/capabilities.py``: vLLM, LMDeploy, plain transformers, SGLang), which decides what the section may set."""

    kind: str = Field(DEFAULT_KIND, description="The engine: a kind of the engine capability table "
                      "(batch_llm.config.capabilities.ENGINES)")
    # Under engine, not top level: it is the runner the engine starts with (vLLM's runner/convert), so it
    # reaches the engine with its section through every start (memory back-off copies included).
    task: Literal["generate", "embed", "classify"] = Field(
        "generate", description="generate: text outputs; embed: one vector per row (vLLM's pooling runner, "
        "last-token pooling for a causal LM) in an ``embedding`` column; classify: class probabilities per row "
        "(``label`` the top class, ``score_<class>`` columns); embed and classify: vllm only")
    embed: EmbedConfig = Field(default_factory=EmbedConfig, description="task: embed settings")
    classify: ClassifyConfig = Field(default_factory=ClassifyConfig, description="task: classify settings")
    max_model_len: int | None = Field(2048, gt=0)
    max_num_seqs: int | None = Field(None, gt=0)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    tensor_parallel_size: int = Field(1, ge=1)
    dtype: str = Field("auto", description="auto: the checkpoint's dtype, except on a CPU without native "
                       "bfloat16 (no AVX-512 BF16 / AMX), where an unquantized model runs in float32 (~5x faster "
                       "there than emulated bf16); the dtype used is in the shard manifest's engine settings")
    quantization: str | None = None
    enforce_eager: bool = False
    enable_prefix_caching: bool | None = None
    kv_cache_dtype: str = "auto"
    speculative: SpeculativeConfig | None = Field(None, description="vLLM n-gram speculative decoding; null: off")
    cpu_kv_cache_gib: int = Field(2, ge=1, description="vLLM CPU backend KV cache, GiB (VLLM_CPU_KVCACHE_SPACE)")
    multiprocessing: bool | None = Field(None, description="vLLM: its engine core in a process of its own "
                                         "(VLLM_ENABLE_V1_MULTIPROCESSING). null: yes on GPUs (vLLM's default: "
                                         "the scheduler overlaps the client's work), no on CPUs, where vLLM would "
                                         "spawn an engine-core and a worker process (each importing vLLM again) "
                                         "and pin the worker to all cores but one; docs/benchmarks.md measures it")
    batch_size: int = Field(16, gt=0, description="transformers engine: rows per static batch")
    cuda_graphs: Literal["offline", "vllm"] = Field(
        "offline", description="vLLM on a GPU: which CUDA graphs the engine captures at start. offline: full graphs "
        "of decode steps only, at 1, 2, 4 ... 128 sequences, every 16 up to 512, then every 32 up to 1024 (48 sizes, "
        "those above max_num_seqs dropped; a batch job's mixed prefill steps carry thousands of tokens, where a graph "
        "saves nothing; below 128 sequences a decode step is bound by reading the weights, so padding it up costs "
        "little; above 512 a step without a graph is bound by the CPU launching its kernels); vllm: vLLM's "
        "own (full and piecewise graphs, 51 sizes each: 102 captures). A compilation_config in engine.extra "
        "wins; speculative decoding, LoRA and the pooling tasks keep vLLM's own")
    torch_compile: bool | None = Field(
        None, description="vLLM: torch.compile of the model (vLLM's compilation mode 3). null: off where the offline "
        "CUDA graphs apply (engine.cuda_graphs: offline on a GPU: the decode steps then run in full graphs of the "
        "uncompiled model with vLLM's own kernels, and the start skips Dynamo and Inductor, cold or warm), vLLM's own "
        "choice elsewhere; true: vLLM's own choice always; false: off (vLLM's compilation mode 0), on a CPU too. A "
        "compilation_config in engine.extra wins")
    extra: dict[str, Any] = Field(default_factory=dict, description="Passed to the engine constructor as is "
                                  "(LMDeploy: `backend` and fields of that backend's engine config). Each key is "
                                  "checked when the config loads against the engine's own arguments, read from its "
                                  "installed source (vLLM: EngineArgs and LLM; SGLang: ServerArgs; LMDeploy: its "
                                  "engine config's fields), a typo refused with the closest name; where the engine "
                                  "is not installed, a warning says the keys were not checked")
    python: str | None = Field(None, description="Interpreter for the engine process (default: this one)")
    compile_cache: str | None = Field(None, description="vLLM's compilation cache: a worker-local folder, or an "
                                      "object-storage prefix (the output's connection) whose archive is synced "
                                      "in before the engine starts and out after; null: vLLM's ~/.cache/vllm")
    precision: Precision = Field(
        "model", description="model: the checkpoint's own precision (and engine.quantization / kv_cache_dtype as "
        "set); auto: engine.precision_gate's candidate (FP8 weights by default) serves where a calibration sample of "
        "the shard's rows agrees with the model's precision within its threshold, else the model's precision; the "
        "decision, the agreement and the sample's size are in the manifest's engine settings (``precision``) and "
        "cached per model, settings and GPU. vllm only")
    precision_gate: PrecisionGateConfig = Field(default_factory=PrecisionGateConfig,
                                                description="engine.precision: auto: the candidate and the gate")
    # Bookkeeping of the shard runner
    commit_every_rows: int = Field(64, gt=0, description="Rows per committed output chunk")
    commit_every_seconds: float = Field(30.0, gt=0)
    progress_every_seconds: float = Field(15.0, gt=0)
    max_error_rate: float = Field(0.1, ge=0, le=1, description="Fail the shard above this share of error rows")
    dedupe_prompts: bool = Field(True, description="Generate identical prompts once per shard (greedy or seeded)")
    memory_backoff: MemoryBackoffConfig = Field(default_factory=MemoryBackoffConfig)
    reasoning_parser: str | None = Field(
        "auto", pattern=r"^[A-Za-z0-9_]+$", description="vLLM's reasoning parser (its --reasoning-parser name): the "
        "thinking parted from the answer (``output`` the answer, ``reasoning`` the thinking), the output schema "
        "applied after the thinking, and sampling.max_thinking_tokens. auto: chosen from the model (batch_llm/"
        "reasoning.py): qwen3 for a Qwen3 architecture whose chat template thinks, deepseek_r1 for another model "
        "whose template opens a <think> block (the DeepSeek-R1 distills, QwQ), none otherwise and on engines "
        "without a reasoning parser; null: none (the output is the model's whole text)")
    limit_mm_per_prompt: dict[str, int] | None = Field(
        None, description="vLLM's limit_mm_per_prompt: the most images one prompt may carry ({image: 1}); a row with "
        "more is the row's error, told by the planner. null: the model's own limit (vLLM, or transformers' processor "
        "and model, refuse a row over it, as the row's error). Only images are read from rows: other modalities are "
        "refused")
    mm_processor_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="vLLM's mm_processor_kwargs (transformers: its processor's call takes "
        "them): settings of the model's image processor, e.g. "
        "{min_pixels: 3136, max_pixels: 1003520} for Qwen2-VL (the pixels an image is resized within). Each key must "
        "be a setting the model's processor has (its preprocessor_config.json or processor_config.json), checked "
        "when the engine starts: the shard fails without retries naming the key and the settings it has")
    sglang: SglangSettings = Field(default_factory=SglangSettings, description="engine.kind: sglang: SGLang's own "
                                   "settings (CUDA graph batch ceiling, KV pool size, chunked prefill, deterministic "
                                   "inference); the engine's other keys map onto SGLang's too (engines/sglang_config.py)")

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, v: str) -> str:
        capabilities(v)  # ValueError: unknown engine kind 'x' (known: ...)
        return v

    @property
    def caps(self) -> EngineCapabilities:
        """What this section's engine serves (its row of the capability table)."""
        return capabilities(self.kind)

    @model_validator(mode="after")
    def _probe_needs_vllm(self) -> "EngineConfig":
        if self.memory_backoff.probe and not self.caps.memory_probe:
            raise ValueError(f"memory_backoff.probe sizes vLLM's batch from its KV cache; engine.kind is {self.kind!r} "
                             f"({who_can('memory_probe')})")
        return self

    @model_validator(mode="after")
    def _pooling_tasks_need_vllm(self) -> "EngineConfig":
        if self.task != "generate" and self.task not in self.caps.pooling_tasks:
            raise ValueError(f"task: {self.task} runs on vLLM's pooling runner; engine.kind is {self.kind!r}: set "
                             f"engine.kind: {engines_serving(lambda c: self.task in c.pooling_tasks)}")
        for task, settings, default in (("embed", self.embed, EmbedConfig()),
                                        ("classify", self.classify, ClassifyConfig())):
            if self.task != task and settings != default:  # not fields_set: with_overrides dumps all
                raise ValueError(f"engine.{task}: settings of engine.task: {task}; engine.task is "
                                 f"{self.task!r} (remove engine.{task} or set engine.task: {task})")
        return self

    @field_validator("limit_mm_per_prompt")
    @classmethod
    def _images_only(cls, v: dict[str, int] | None) -> dict[str, int] | None:
        if v is None:
            return v
        other = sorted(set(v) - {"image"})
        if other:
            raise ValueError(f"{', '.join(other)}: only images are read from rows; set {{image: N}}")
        if any(n < 0 for n in v.values()):
            raise ValueError(f"a limit is 0 or more: {v}")
        return v

    @model_validator(mode="after")
    def _precision_gate_applies(self) -> "EngineConfig":
        if self.precision == "model":
            if self.precision_gate != PrecisionGateConfig():
                raise ValueError("engine.precision_gate: settings of engine.precision: auto; engine.precision is "
                                 "'model' (remove engine.precision_gate or set engine.precision: auto)")
            return self
        if self.kind != "vllm":
            raise ValueError(f"engine.precision: auto calibrates on vLLM; engine.kind is {self.kind!r} (set "
                             "engine.kind: vllm, or engine.precision: model)")
        taken = sorted(k for k in self.precision_gate.candidate
                       if getattr(self, k) != type(self).model_fields[k].get_default())
        if taken:
            raise ValueError(f"engine.{taken[0]} is set and engine.precision: auto would choose it: set one of the "
                             f"two (engine.precision: model keeps engine.{taken[0]} as set)")
        if self.task != "generate":
            raise ValueError(f"engine.precision: auto compares generated tokens; engine.task is {self.task!r}")
        return self

    @model_validator(mode="after")
    def _every_key_honored(self) -> "EngineConfig":
        """A key the engine would not honor is refused here, naming it, never dropped at start."""
        if "trust_remote_code" in self.extra:
            raise ValueError("engine.extra.trust_remote_code: set model.trust_remote_code instead")
        caps = self.caps
        defaults = type(self).model_fields
        problems = [f"engine.{key}: {what}; engine.kind is {self.kind!r} ({who_can(feature)}): remove engine.{key}"
                    for key, feature, what in _ENGINE_ONLY_KEYS
                    if getattr(self, key) != defaults[key].get_default(call_default_factory=True)
                    and not getattr(caps, feature)]
        if self.speculative is not None and "speculative_config" in self.extra:
            problems.append("engine.extra.speculative_config: set engine.speculative or engine.extra."
                            "speculative_config, not both")
        problems += [f"engine.{other.settings_section}: settings of engine.kind: {kind}; engine.kind is "
                     f"{self.kind!r} (remove engine.{other.settings_section} or set engine.kind: {kind})"
                     for kind, other in ENGINES.items() if other.settings_section and kind != self.kind
                     and getattr(self, other.settings_section, None) != type(getattr(self, other.settings_section))()]
        problems += caps.problems(self)
        if not problems:  # the engine's own argument list, once the keys this project maps are refused above
            from batch_llm.config.engine_args import extra_problems

            problems = extra_problems(self.kind, self.extra)
        if problems:
            raise ValueError("; ".join(problems))
        return self


# apply_chat_template's own arguments: a template variable of one of these names would be taken as the argument
RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tools", "documents", "chat_template",
                                      "add_generation_prompt", "continue_final_message", "tokenize", "padding",
                                      "truncation", "max_length", "return_tensors", "return_dict",
                                      "return_assistant_tokens_mask", "tokenizer_kwargs"})

# torch's generators (vLLM's per-request seeds, the transformers engine) take 64-bit seeds; vLLM reads -1 as "no
# seed". Non-negative int64 leaves room for output_retries' reseeding (seed + 1_000_003 per attempt).
MAX_SEED = 2**63 - 1
# vLLM keeps token counts, top_k and token ids in int32 tensors; a larger integer would fail the engine, not the row
MAX_INT32 = 2**31 - 1


class Bound(typing.NamedTuple):
    """The range of one sampling value: [lo, hi], or (lo, hi] where ``lo_open``."""

    lo: int | float
    hi: int | float
    lo_open: bool = False

    def field(self) -> dict[str, Any]:
        """The bound as pydantic ``Field`` constraints (the sampling section's keys)."""
        return {"gt" if self.lo_open else "ge": self.lo, "le": self.hi}

    def holds(self, v: int | float) -> bool:
        """Whether ``v`` is within (NaN is within no bound)."""
        return (self.lo < v if self.lo_open else self.lo <= v) and v <= self.hi

    def __str__(self) -> str:
        return f"{'(' if self.lo_open else '['}{self.lo}, {self.hi}]"


# Every sampling value's bounds, the engine's own (vLLM's SamplingParams._verify_args; logprobs: its default
# max_logprobs, OpenAI's top_logprobs limit; n: OpenAI's limit, well under vLLM's 16384 samples a request): the
# sampling section's keys and a row's own values (rows/params.py) are held to this one table, so a row outside it is
# that row's error, never an engine failure that takes the run's other rows with it.
SAMPLING_BOUNDS: dict[str, Bound] = {
    "max_tokens": Bound(1, MAX_INT32), "n": Bound(1, 128), "logprobs": Bound(0, 20), "seed": Bound(0, MAX_SEED),
    "top_k": Bound(-1, MAX_INT32), "max_thinking_tokens": Bound(0, MAX_INT32),
    "temperature": Bound(0.0, 2.0), "top_p": Bound(0.0, 1.0, lo_open=True), "min_p": Bound(0.0, 1.0),
    "presence_penalty": Bound(-2.0, 2.0), "frequency_penalty": Bound(-2.0, 2.0),
    "repetition_penalty": Bound(0, 100, lo_open=True),
}
# Stop strings are matched against every output's tail at every step: their count and length bound that work
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
TOKEN_ID = Bound(0, MAX_INT32)
_BOUNDS = SAMPLING_BOUNDS  # the sampling section's fields read their bounds from it


def stop_problem(stops: typing.Sequence[str]) -> str | None:
    """Why a list of stop strings cannot be used (empty strings, too many, too long), or None."""
    if any(not x for x in stops):
        return f"an empty stop string matches everywhere: {list(stops)!r}"
    if len(stops) > MAX_STOP_STRINGS:
        return f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}"
    longest = max(stops, key=len, default="")
    if len(longest) > MAX_STOP_CHARS:
        return f"a stop string is at most {MAX_STOP_CHARS} characters, got one of {len(longest)}"
    return None


def token_ids_problem(ids: typing.Sequence[int], name: str, *, most: int | None = MAX_STOP_TOKEN_IDS) -> str | None:
    """Why a list of token ids cannot be used (outside ``TOKEN_ID``, more than ``most``), or None."""
    if most is not None and len(ids) > most:
        return f"{name}: at most {most} token ids, got {len(ids)}"
    if (bad := next((t for t in ids if not TOKEN_ID.holds(t)), None)) is not None:
        return f"{name}: token ids are in {TOKEN_ID}, got {bad}"
    return None


class SamplingConfig(_Section):
    """The default sampling of every request; a row may set its own (``rows/params.py``). A row's values are held to
    the bounds shown here (the engine's own, vLLM's SamplingParams ranges: one table, ``SAMPLING_BOUNDS``); a row
    outside them is that row's error with the reason, the other rows go on."""

    max_tokens: int = Field(256, **_BOUNDS["max_tokens"].field(), description="The output limit of a row that "
                            "sets none")
    max_tokens_cap: int | None = Field(None, **_BOUNDS["max_tokens"].field(), description="When set, no row "
                                       "generates more than this (rows asking for more are capped and counted)")
    temperature: float = Field(0.0, **_BOUNDS["temperature"].field())
    top_p: float = Field(1.0, **_BOUNDS["top_p"].field())
    seed: int | None = Field(0, **_BOUNDS["seed"].field())
    stop: list[str] = Field(default_factory=list, description="Strings that end the output: at most "
                            f"{MAX_STOP_STRINGS}, each of 1 to {MAX_STOP_CHARS} characters (a row's own too)")
    ignore_eos: bool = False
    n: int = Field(1, **_BOUNDS["n"].field(), description="Samples per row (vLLM): the row's ``outputs`` list holds "
                   "them all, ``output`` the first; completion tokens count every sample")
    logprobs: int | None = Field(None, **_BOUNDS["logprobs"].field(), description="Log-probabilities per generated "
                                 "token (vLLM): the chosen token's and the top-k candidates' (0: the chosen token's "
                                 "only) in the row's ``logprobs`` column; null: none")
    top_k: int = Field(0, **_BOUNDS["top_k"].field(), description="Sample from the k most likely tokens; 0 or -1: off "
                       "(the engines' row of the capability table says which apply it)")
    min_p: float = Field(0.0, **_BOUNDS["min_p"].field(), description="Drop tokens below this share of the most "
                         "likely token's probability; 0: off")
    repetition_penalty: float = Field(1.0, **_BOUNDS["repetition_penalty"].field(), description="Above 1 discourages "
                                      "tokens already in the prompt or output (vLLM's and transformers' "
                                      "multiplicative penalty); 1: off")
    stop_token_ids: list[int] = Field(default_factory=list, description="Token ids that end the output, besides "
                                      f"the model's end-of-sequence tokens: at most {MAX_STOP_TOKEN_IDS}, each in "
                                      f"{TOKEN_ID} (a row's own, and its prompt_token_ids, too)")
    include_stop_str_in_output: bool = Field(False, description="Keep the stop string that ended an output at its end")
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict, description="Variables of the chat template "
                                                 "(e.g. enable_thinking: false for Qwen3); a row's own are laid over "
                                                 "these. Every engine: the prompts are rendered before the engine. "
                                                 "Each key must be a variable the chat template reads: checked when "
                                                 "the config loads where the template is known (model.chat_template, "
                                                 "a local model folder), else when the model is fetched")
    output_schema: dict | None = Field(None, description="The JSON Schema every output must match: the schema, "
                                       "or a string naming it, a JSON Schema file (./relative to this YAML) or a "
                                       "pydantic model (module:Class), loaded into the schema itself when the "
                                       "config loads")
    guided_decoding: bool | Literal["fallback"] = Field(
        True, description="Decode under output_schema (vLLM, xgrammar); false: outputs are only checked against it; "
        "fallback: decoded freely first (at the plain rate), and only the rows whose output does not match are "
        "decoded again under the schema (one more pass, before output_retries). On vLLM 0.26 a guided step runs "
        "at ~0.5 of a plain one on the H200 (docs/benchmarks.md): for a model that mostly answers in shape, "
        "fallback costs about the plain run plus the misses")
    guided_length_bounds: Literal["grammar", "check"] = Field(
        "grammar", description="Where output_schema's string length bounds (minLength / maxLength) hold: grammar "
        "(decoded under them: every output within them) or check (decoded under the schema without them, then "
        "checked: an output outside them is an invalid_output row, asked again under output_retries). Bounded "
        "strings cost xgrammar ~26x the mask work per token with a 7B tokenizer (bench grammar-cost), work vLLM "
        "fills in parallel: on the H200 the guided rate moved 0.498 -> 0.514 of plain without them (the schema "
        "compiles in 20 ms instead of 889)")
    output_retries: int = Field(0, ge=0, le=5, description="Ask again, with another seed, for a sampled row "
                                "(temperature > 0) whose output does not match output_schema")
    thinking: Literal["auto", "on", "off"] = Field(
        "auto", description="A reasoning model's thinking, through its chat template's switch (enable_thinking or "
        "thinking, the template variables sampling.chat_template_kwargs sets too): auto: the template's default; "
        "on / off: the switch set. off on a model whose template has no switch, or on on one that does not think, "
        "is refused (batch_llm/reasoning.py). A row's own thinking column or chat_template_kwargs wins")
    max_thinking_tokens: int | None = Field(
        None, **_BOUNDS["max_thinking_tokens"].field(), description="vLLM's thinking budget (thinking_token_budget): "
        "after this many thinking tokens the engine writes the end of the thinking and the answer follows. Needs "
        "engine.reasoning_parser. null: none (thinking may use all of max_tokens)")

    # before the type check, so the field holds only the schema itself (a name is loaded here, on assignment too)
    @field_validator("output_schema", mode="before", json_schema_input_type=dict | str | None)
    @classmethod
    def _load_output_schema(cls, v: Any) -> Any:
        from batch_llm.output_schema import check_schema, load_schema

        if isinstance(v, str):
            return check_schema(load_schema(v))
        return check_schema(v) if isinstance(v, dict) else v  # anything else: the dict | None check refuses it

    @field_validator("top_k")
    @classmethod
    def _one_off_value(cls, v: int) -> int:
        return 0 if v == -1 else v  # vLLM's two spellings of "off": one value for the result cache's key

    @field_validator("stop_token_ids")
    @classmethod
    def _token_ids(cls, v: list[int]) -> list[int]:
        if problem := token_ids_problem(v, "stop_token_ids"):
            raise ValueError(problem)
        return v

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables(cls, v: dict[str, Any]) -> dict[str, Any]:
        reserved = sorted(set(v) & RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise ValueError(f"{', '.join(reserved)}: arguments of the tokenizer's apply_chat_template, not "
                             "template variables")
        return v

    @model_validator(mode="after")
    def _one_thinking_switch(self) -> "SamplingConfig":
        both = sorted(set(self.chat_template_kwargs) & set(SWITCH_VARIABLES))
        if both and self.thinking != "auto":
            raise ValueError(f"thinking: {self.thinking} and chat_template_kwargs.{both[0]} both switch thinking; "
                             "set one of them")
        return self

    @field_validator("stop")
    @classmethod
    def _usable_stops(cls, v: list[str]) -> list[str]:
        # every row would be refused for it (row_params): refused once, here
        if problem := stop_problem(v):
            raise ValueError(problem)
        return v

    @model_validator(mode="after")
    def _default_within_cap(self) -> "SamplingConfig":
        if self.max_tokens_cap is not None and self.max_tokens > self.max_tokens_cap:
            raise ValueError(f"max_tokens ({self.max_tokens}) is above max_tokens_cap ({self.max_tokens_cap})")
        return self




# The generated text fields the word lists scan: the answer, and a reasoning model's thinking (engine.reasoning_parser)
ScannedField = Literal["output", "reasoning"]


class WordListConfig(_Section):
    """A sensitive-word list and what to do on a hit: flag the row, mask the word, or drop the row."""

    name: str
    path: str = Field(description="A file (one word per line, # comments) or builtin:en / builtin:zh")
    action: Literal["flag", "mask", "drop"] = "mask"
    scan: list[ScannedField] | None = Field(None, description="The fields this list scans; null: filter.scan")
    fold: list[Literal["confusables", "han_variants", "separators"]] = Field(
        default_factory=list, description="Look-alike spellings this list also matches (stages/confusables.py). "
        "confusables: each character as its Unicode TR39 skeleton (a Cyrillic а in an English word is a; small "
        "capitals ᴄᴀꜱɪɴᴏ are casino), combining accents dropped; ASCII stays as it is. han_variants: traditional "
        "Chinese characters as simplified (賭博 is 赌博). separators: a run of separators of any length between "
        "two letters or digits dropped: spaces, tabs, line breaks, dashes, underscores, dots, symbols (傻 逼, "
        "b  a  d, ca-sino); clause and sentence punctuation stays. Their false positives on the sample data: "
        "docs/user-guide.md")
    match: Literal["word", "prefix", "stem"] = Field(
        "word", description="How a listed word of ASCII letters matches: word: whole words only (ass is not in "
        "class); prefix: also any word that starts with it (casino: casinos, casinobonus); stem: also the word "
        "with an English ending, s, es, ed, d, ing, ings, er, ers (casinos, casino_bonus). A hit covers the "
        "word form. Other words (Chinese) match anywhere whatever this says")

    @field_validator("fold")
    @classmethod
    def _each_fold_once(cls, v: list[str]) -> list[str]:
        return sorted(set(v))  # one spelling per set of folds: lists of the same folds share one folded text


# The review template's placeholders (stages/review.py fills them; any other {...} is left as written)
REVIEW_PLACEHOLDERS = ("prompt", "output", "reasoning", "categories")
REVIEW_CATEGORIES = ["violence", "sexual", "hate", "harassment", "self_harm", "illegal", "privacy", "other"]
_REVIEW_ACTIONS = Literal["flag", "mask", "drop"]


class ReviewConfig(_Section):
    """Content review by a model (``stages/review.py``): after the shards, a guard or classifier model reads each
    (prompt, output) and says ``safe`` or ``unsafe`` with categories, in a second inference pass of its own
    (mapped over the shards like ``batch_inference``: lease, worker, chunk commits, resume, result cache). The
    verdict becomes the row's ``review_verdict`` and ``review_categories``; ``action`` / ``actions`` say what an
    unsafe verdict does (flag the row, mask the output, drop the row), as the word lists' actions do.

    ``engine.task: generate`` (a guard model asked by ``template``, its answer decoded under the JSON schema
    ``{"verdict": "safe" | "unsafe", "categories": [...]}``) or ``engine.task: classify`` (a classifier: its top
    class mapped to a verdict by ``labels``; an unsafe class is the category)."""

    enabled: bool = True
    model: ModelConfig = Field(description="The review model, fetched like model: a ModelScope id, a local "
                               "folder or an object-storage prefix")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="The review model's engine (its own "
                                 "settings: a guard model is often smaller than the model it reviews); task: "
                                 "generate or classify")
    template: str | None = Field(None, description="The review prompt; {prompt}, {output}, {reasoning} and "
                                 "{categories} are filled per row (other braces stay as written). null: a prompt "
                                 "asking for the JSON verdict (generate), {output} alone (classify)")
    system_prompt: str | None = Field(None, description="A system message before the review prompt (chat only)")
    chat: bool | None = Field(None, description="Send the review prompt as a chat (the model's chat template) or "
                              "as plain text; null: chat for generate, plain text for classify")
    reasoning: bool = Field(False, description="Show the row's reasoning (the reasoning column of a reasoning "
                            "model) to the review model too: the template's {reasoning}")
    categories: list[str] = Field(default_factory=lambda: list(REVIEW_CATEGORIES), min_length=1,
                                  description="generate: the categories a verdict may name (the schema's enum)")
    max_tokens: int = Field(64, gt=0, description="generate: the verdict's token limit")
    guided_decoding: bool = Field(True, description="generate: decode the verdict under its JSON schema (vLLM); "
                                  "false: only check it (a verdict that does not parse is a review error)")
    labels: dict[str, Literal["safe", "unsafe"]] = Field(
        default_factory=dict, description="classify: each class of the model and its verdict; an unsafe class is "
        "the row's category. With engine.classify.labels, the same classes")
    action: _REVIEW_ACTIONS = Field("flag", description="What an unsafe verdict does: flag (the row keeps its "
                                    "output, review_verdict says unsafe), mask (the whole output masked), drop (the "
                                    "row goes to the errors: dropped by review: <category>)")
    actions: dict[str, _REVIEW_ACTIONS] = Field(default_factory=dict, description="Per category, overriding "
                                                "action; a verdict of several categories takes the strongest "
                                                "(drop, then mask, then flag)")
    images: Literal["text", "agreement", "content"] = Field(
        "text", description="What the review does with a row's images (image parts, input.image_columns). text: "
        "they are left out (a text-only review model reads the prompt's text and the output); agreement: the review "
        "model, a vision-language model, is shown them and asked (image_template) whether the output agrees with "
        "them: a disagreement is an unsafe verdict of image_category, with the same actions; content: shown them with "
        "the ordinary review prompt. Rows without images always get the ordinary prompt. generate only")
    image_template: str | None = Field(None, description="images: agreement: the review prompt of a row with images "
                                       "({prompt}, {output}, {reasoning}, {categories} filled as in template); null: "
                                       "a prompt asking whether the output agrees with the image, in the verdict's JSON")
    image_category: str = Field("image_mismatch", min_length=1, description="images: agreement: the category of an "
                                "output that does not agree with its image (a category of the verdict's schema, "
                                "which actions may name)")
    on_error: Literal["flag", "drop"] = Field("drop", description="A row the review could not judge (the review "
                                              "model failed on it, or its answer did not parse): drop (to the errors: "
                                              "review failed: <reason>) or flag (kept, review_verdict: error)")

    @model_validator(mode="after")
    def _settings_of_the_task(self) -> "ReviewConfig":
        task, problems = self.engine.task, []
        if task == "embed":
            problems.append("engine.task: embed gives vectors, not a verdict: use generate (a guard model) or "
                            "classify (a classifier)")
        if task == "classify":
            # compared with the defaults, not model_fields_set: with_overrides dumps every field
            defaults = type(self).model_fields
            given = [k for k in ("categories", "max_tokens", "guided_decoding")
                     if getattr(self, k) != defaults[k].get_default(call_default_factory=True)]
            problems += [f"{k}: a setting of engine.task: generate (remove it)" for k in given]
            if not self.labels:
                problems.append("labels: map each class of the classifier to safe or unsafe")
            head = self.engine.classify.labels
            if head is not None and set(head) != set(self.labels):
                problems.append(f"labels {sorted(self.labels)}: name the classes of engine.classify.labels "
                                f"{sorted(head)}, each once")
        elif self.labels:
            problems.append("labels: a setting of engine.task: classify (remove it)")
        if task == "generate" and self.guided_decoding and not self.engine.caps.guided_decoding:
            problems.append(f"guided_decoding: engine {self.engine.kind} cannot decode under a schema "
                            f"({who_can('guided_decoding')}); set guided_decoding: false to only check the verdicts")
        known = set(self.verdict_categories) if task == "generate" else \
            {k for k, v in self.labels.items() if v == "unsafe"}
        problems += [f"actions.{k}: not a category of the review ({', '.join(sorted(known))})"
                     for k in self.actions if k not in known]
        for key, template in (("template", self.template), ("image_template", self.image_template)):
            if template is None:
                continue
            named = set(re.findall(r"\{(" + "|".join(REVIEW_PLACEHOLDERS) + r")\}", template))
            if "output" not in named:
                problems.append(f"{key}: it never shows the output to review: put {{output}} in it")
            if self.reasoning and "reasoning" not in named:
                problems.append(f"{key}: reasoning is true but the template has no {{reasoning}}")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @model_validator(mode="after")
    def _image_settings(self) -> "ReviewConfig":
        problems = []
        if self.engine.task == "classify" and self.images != "text":
            problems.append(f"images: {self.images}: a classifier reads the output as text (images: text, or leave "
                            "it out)")
        defaults = type(self).model_fields
        if self.images != "agreement":
            given = [k for k in ("image_template", "image_category") if getattr(self, k) != defaults[k].default]
            problems += [f"{k}: a setting of images: agreement (remove it)" for k in given]
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def verdict_categories(self) -> list[str]:
        """The categories a generate-style verdict may name: ``categories``, and ``image_category`` where rows with
        images are asked whether the output agrees with them."""
        extra = [self.image_category] if self.images == "agreement" and self.image_category not in \
            self.categories else []
        return [*self.categories, *extra]


class FilterConfig(_Section):
    enabled: bool = True
    lists: list[WordListConfig] = Field(default_factory=lambda: [
        WordListConfig(name="en", path="builtin:en", action="mask"),
        WordListConfig(name="zh", path="builtin:zh", action="mask"),
    ])
    mask_char: str = Field("*", min_length=1, max_length=1)
    case_sensitive: bool = False
    scan: list[ScannedField] = Field(default_factory=lambda: list(typing.get_args(ScannedField)), min_length=1,
                                     description="The fields every list scans unless it names its own (scan): the "
                                     "answer (output, every sample) and a reasoning model's thinking (reasoning). "
                                     "The log-probabilities' tokens and their alternatives hold both: every list "
                                     "scans them. A mask hides a hit in every copy of it (docs/user-guide.md, "
                                     "Content filter)")
    review: ReviewConfig | None = Field(None, description="Content review by a model after the word lists' "
                                        "scan (stages/review.py); null: none")


class EvaluateConfig(_Section):
    enabled: bool = True
    sample_rows: int | None = Field(2000, gt=0, description="Score a deterministic sample of this many rows "
                                    "with references (null scores every row)")
    sample_seed: int = Field(0, description="Seed of the sample: the same seed picks the same rows")
    min_score: float | None = Field(None, description="Fail the run when the metric falls below this")
    metric: str = Field("Rouge-L-F", description="EvalScope metric that min_score applies to (any case or "
                        "separators: rouge-l-f, rouge_l_f; stored as EvalScope spells it)")

    @field_validator("metric")
    @classmethod
    def _known_metric(cls, v: str) -> str:
        # A name the gate would not find makes min_score a silent no-op: refused here, spelled as EvalScope does.
        from batch_llm.config.metric_names import canonical_metric

        return canonical_metric(v)


class TableCatalogConfig(_Section):
    """The Iceberg catalog that names the table (``output.table.format: iceberg``), through pyiceberg."""

    type: Literal["sql", "rest"] = Field("sql", description="sql: pyiceberg's SQL catalog (SQLite, PostgreSQL); "
                                         "rest: an Iceberg REST catalog")
    uri: str | None = Field(None, description="sql: the catalog database's SQLAlchemy URL (production: "
                            "postgresql+psycopg2://...; default sqlite:///<output.path>/_iceberg/catalog.db, for a "
                            "local output.path); rest: the catalog's URL. conn_id instead keeps credentials out of "
                            "the YAML")
    conn_id: str | None = Field(None, description="An Airflow connection for the catalog: sql, a database "
                                "connection (the Airflow metadata database's PostgreSQL server will do); rest, "
                                "host = the URL, login/password = OAuth2 client id/secret (a password alone: a "
                                "bearer token), extra = more pyiceberg catalog properties")
    warehouse: str | None = Field(None, description="Where the table's data and metadata files go, local or "
                                  "s3:// through output.conn_id; default <output.path>/_iceberg/warehouse (rest: "
                                  "the catalog's own default when unset)")
    name: str = Field("batch_llm", description="The catalog's name (the SQL catalog's catalog_name column)")


class TableConfig(_Section):
    """Publish into a table instead of the file versions: each run replaces its partition in one commit."""

    format: Literal["delta", "iceberg"]
    location: str | None = Field(None, description="delta: the table's folder, local or s3:// through "
                                 "output.conn_id; default <output.path>/<pipeline>/_table")
    name: str | None = Field(None, description="iceberg: the table as namespace.table; default "
                             "batch_llm.<pipeline name>")
    catalog: TableCatalogConfig = Field(default_factory=TableCatalogConfig)
    partition_columns: dict[str, str] | None = Field(
        None, description="The table's partition columns and the value each run writes ({ds}: the run's date); "
        "default output.partition read as column=value (dt={ds}: a string column dt)")
    retention_hours: float = Field(168.0, ge=1, description="Delta vacuum / Iceberg snapshot expiry after each "
                                   "publish keep every snapshot younger than this (time travel and running readers "
                                   "need them) and the current one always")
    commit_attempts: int = Field(5, ge=1, description="Times a publish writes its partition again after a "
                                 "concurrent writer's commit to the same table came first, before it fails")

    @field_validator("partition_columns")
    @classmethod
    def _columns_and_templates(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        for col, template in (v or {}).items():
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", col):
                raise ValueError(f"partition column {col!r}: a name of letters, digits and '_'")
            if problem := path_policy.template_problem(template):
                raise ValueError(f"partition column {col!r}: {problem}")
        if v is not None and not v:
            raise ValueError("name at least one partition column, or leave the key out")
        return v

    @field_validator("name")
    @classmethod
    def _namespace_dot_table(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*\.[A-Za-z0-9_]+", v):
            raise ValueError(f"{v!r}: name the Iceberg table as namespace.table (letters, digits, '_')")
        return v

    @model_validator(mode="after")
    def _keys_of_the_format(self) -> "TableConfig":
        if self.format == "delta" and self.name is not None:
            raise ValueError("name is the Iceberg table's; a Delta table is named by its location")
        if self.format == "iceberg" and self.location is not None:
            raise ValueError("location is the Delta table's; an Iceberg table's files go to catalog.warehouse")
        return self


class OutputConfig(_Section):
    """Where a run writes: ``<path>/<pipeline>/runs/<run>/`` for artifacts, ``<path>/<pipeline>/<partition>``
    for the published dataset."""

    path: str
    conn_id: str | None = None
    partition: str = Field("dt={ds}", description="Published partition under the pipeline prefix: one folder "
                           "name (no '/', not '..'); {ds} is the run's date")
    orphan_grace_hours: float = Field(24.0, gt=0, description="A version folder never made current (its "
                                      "publisher was killed) or a temporary file in the partition is removed by "
                                      "the next publish once nothing in it changed for this long")
    table: TableConfig | None = Field(None, description="Publish into a Delta or Iceberg table (the tables "
                                      "extra) instead of the file versions; the run's artifacts stay under path")

    @field_validator("partition")
    @classmethod
    def _one_folder_in_the_pipeline(cls, v: str) -> str:
        # filled with the run's date, it names a folder next to runs/: it must not reach out of the pipeline's
        if problem := path_policy.partition_template_problem(v):
            raise ValueError(problem)
        return v

    @model_validator(mode="after")
    def _table_partition_and_catalog(self) -> "OutputConfig":
        t = self.table
        if t is None:
            return self
        if t.partition_columns is None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", self.partition):
            raise ValueError(f"table: output.partition {self.partition!r} is not column=value (dt={{ds}}): set "
                             "output.table.partition_columns")
        c = t.catalog
        if t.format == "iceberg" and c.type == "sql" and not (c.uri or c.conn_id) \
                and not path_policy.resolve(self.path).is_local:
            raise ValueError("table.catalog: the default SQLite catalog lives in a local output.path; with "
                             f"output.path {self.path!r} set catalog.uri or catalog.conn_id (PostgreSQL)")
        if t.format == "iceberg" and c.type == "rest" and not (c.uri or c.conn_id):
            raise ValueError("table.catalog: a rest catalog needs uri or conn_id")
        return self


class CacheConfig(_Section):
    """The result cache: earlier outputs reused by content key (see ``result_cache.py`` for the layout)."""

    enabled: bool = True
    path: str | None = Field(None, description="default: <output.path>/_cache")
    max_age_days: float | None = Field(90.0, gt=0, description="Entries older than this are misses and are "
                                       "dropped at compaction; null keeps them forever")
    compact_after_tables: int = Field(64, ge=2, description="Compact a namespace once it holds this many "
                                      "shard tables (the publish task does it)")
    max_runs: int = Field(8, ge=1, description="Compacted runs kept before they are merged into one")


class AirflowConfig(_Section):
    schedule: str | None = None
    start_date: str = "2026-01-01"
    catchup: bool = False
    retries: int = Field(2, ge=0)
    retry_delay_seconds: int = Field(30, ge=0)
    gpu_pool: str = "gpu"
    gpu_queue: str = "gpu"
    tags: list[str] = Field(default_factory=list)
    execution_timeout_minutes: int | None = Field(None, gt=0)


class PipelineConfig(_Section):
    name: str
    description: str = ""
    model: ModelConfig
    quantize: QuantizeConfig = Field(default_factory=QuantizeConfig)
    input: InputConfig
    sharding: ShardingConfig = Field(default_factory=ShardingConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    filter: FilterConfig = Field(default_factory=FilterConfig)
    evaluate: EvaluateConfig = Field(default_factory=EvaluateConfig)
    output: OutputConfig
    cache: CacheConfig = Field(default_factory=CacheConfig)
    airflow: AirflowConfig = Field(default_factory=AirflowConfig)

    @field_validator("name")
    @classmethod
    def _dag_id_safe(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", v):
            raise ValueError("use letters, digits, '_', '.' or '-' (it becomes the DAG id)")
        if not v.strip("."):  # '.' or '..' as a folder under output.path would be that folder or its parent
            raise ValueError(f"{v!r} is a path, not a name: use at least one letter, digit, '_' or '-'")
        return v

    @model_validator(mode="after")
    def _guided_decoding_needs_vllm(self) -> "PipelineConfig":
        s = self.sampling
        if s.output_schema is not None and s.guided_decoding and not self.engine.caps.guided_decoding:
            raise ValueError(f"sampling.output_schema: engine {self.engine.kind} cannot decode under a schema "
                             f"({who_can('guided_decoding')}); set sampling.guided_decoding: false to only check "
                             "the outputs")
        return self

    @model_validator(mode="after")
    def _samples_need_vllm(self) -> "PipelineConfig":
        s = self.sampling
        asked = [k for k, on in (("n", s.n > 1), ("logprobs", s.logprobs is not None)) if on]
        if asked and not self.engine.caps.samples_and_logprobs:
            raise ValueError(f"sampling.{' and sampling.'.join(asked)}: engine {self.engine.kind} returns one "
                             f"sample without log-probabilities ({who_can('samples_and_logprobs')}); remove "
                             f"{' and '.join('sampling.' + k for k in asked)} or set engine.kind: "
                             f"{engines_serving('samples_and_logprobs')}")
        return self

    @model_validator(mode="after")
    def _sampling_keys_the_engine_applies(self) -> "PipelineConfig":
        s, caps = self.sampling, self.engine.caps
        defaults = type(s).model_fields
        given = [k for k in sorted(EXTRA_SAMPLING_KEYS) if getattr(s, k) != defaults[k].get_default(
            call_default_factory=True)]
        lacking = [k for k in given if k not in caps.sampling_keys]
        problems = []
        for key in lacking:
            def applies(c: EngineCapabilities, key: str = key) -> bool:
                return key in c.sampling_keys

            problems.append(f"sampling.{key}: engine {self.engine.kind} does not apply it ({who_can(applies)}); "
                            f"remove sampling.{key} or set engine.kind: {engines_serving(applies)}")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @model_validator(mode="after")
    def _image_columns_need_images(self) -> "PipelineConfig":
        """Every row of a table with image columns would be refused: said once, here (a JSONL row's own image
        parts on such an engine are its error, naming the engines that take images)."""
        e = self.engine
        if self.input.image_columns and (why := takes_no_images(e.kind)):
            raise ValueError(f"input.image_columns: {why}")
        if self.input.image_columns and e.task != "generate":
            raise ValueError(f"input.image_columns: engine.task {e.task} is not tested with images; use "
                             "engine.task: generate")
        return self

    @model_validator(mode="after")
    def _review_needs_text(self) -> "PipelineConfig":
        if self.filter.review is not None and self.filter.review.enabled and self.engine.task != "generate":
            raise ValueError(f"filter.review: engine.task {self.engine.task} writes no text to review; remove "
                             "filter.review or set filter.review.enabled: false")
        return self

    @model_validator(mode="after")
    def _reasoning_needs_a_parser(self) -> "PipelineConfig":
        """A reasoning parser and a thinking budget are vLLM's (the capability table's ``reasoning``): named on
        another engine they are refused, never dropped; a budget needs the parser that finds the thinking."""
        e, s = self.engine, self.sampling
        problems = []
        if e.reasoning_parser not in ("auto", None) and not e.caps.reasoning:
            problems.append(f"engine.reasoning_parser: engine {e.kind} has no reasoning parser ({who_can('reasoning')}"
                            f"); remove it (the output is then the model's whole text) or set engine.kind: "
                            f"{engines_serving('reasoning')}")
        if s.max_thinking_tokens is not None:
            if not e.caps.reasoning:
                problems.append(f"sampling.max_thinking_tokens: engine {e.kind} has no thinking budget "
                                f"({who_can('reasoning')}); remove it or set engine.kind: {engines_serving('reasoning')}")
            elif e.reasoning_parser is None:
                problems.append("sampling.max_thinking_tokens: a thinking budget needs the reasoning parser that "
                                "finds the thinking; engine.reasoning_parser is null (set it, or auto)")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @model_validator(mode="after")
    def _template_kwargs_are_template_variables(self) -> "PipelineConfig":
        """``sampling.chat_template_kwargs`` keys the chat template reads, where the template is known when the
        config loads (``model.chat_template``, or a local model folder's); a model fetched later is checked by
        the fetch stage (``stages.infer.identity.reasoning_problems``), before any engine starts."""
        if not self.sampling.chat_template_kwargs:
            return self
        from batch_llm.host.probes import model_chat_template
        from batch_llm.reasoning import template_kwargs_problem

        template, where = self.model.chat_template, "model.chat_template"
        ref = path_policy.resolve(self.model.ref)
        if not template and ref.is_local and ref.local_path and os.path.isdir(ref.local_path):
            template, where = model_chat_template(ref.local_path), f"the model's, at {ref.local_path}"
        if problem := template_kwargs_problem(self.sampling.chat_template_kwargs, template, where):
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _pooling_tasks_take_no_generation_settings(self) -> "PipelineConfig":
        task = self.engine.task
        if task == "generate":
            return self
        s = self.sampling
        # settings that would silently do nothing are refused, like an unknown key
        defaults = type(s).model_fields
        given = [k for k, on in (("output_schema", s.output_schema is not None), ("n", s.n > 1),
                                 ("logprobs", s.logprobs is not None), ("output_retries", s.output_retries > 0),
                                 ("max_thinking_tokens", s.max_thinking_tokens is not None)) if on] \
            + [k for k in sorted(EXTRA_SAMPLING_KEYS) if getattr(s, k) != defaults[k].get_default(
                call_default_factory=True)]
        # template variables (thinking too) still shape the prompt a pooling task reads
        cols = [c for c in self.input.sampling_columns
                if c not in ("max_tokens", "chat_template_kwargs", "thinking", "reasoning_effort")]
        problems = [f"sampling.{k}" for k in given] + [f"input.sampling_columns: {c}" for c in cols]
        if problems:
            raise ValueError(f"{', '.join(problems)}: generation settings; engine.task: {task} generates no "
                             "text (remove them)")
        if self.model.lora is not None and not self.model.lora.merge:
            raise ValueError(f"model.lora.merge: false: a served adapter is not tested with engine.task: {task}; "
                             "set model.lora.merge: true (the adapter is merged into the model at fetch)")
        return self

    @model_validator(mode="after")
    def _served_adapter_needs_vllm(self) -> "PipelineConfig":
        lora = self.model.lora
        if lora is not None and not lora.merge and not self.engine.caps.lora_served:
            raise ValueError(f"model.lora.merge: false serves the adapter unmerged, which engine {self.engine.kind} "
                             f"cannot ({who_can('lora_served')}); set model.lora.merge: true to merge it into the "
                             "model at fetch")
        return self

    def with_overrides(self, overrides: Mapping[str, Any], source: str = "params") -> "PipelineConfig":
        """A copy with dotted-key overrides applied (``{"sampling.temperature": 0.7}``), validated again; this
        config itself where they change nothing (a trigger form left as the pipeline has it), not validated twice."""
        data = apply_overrides(self.model_dump(), overrides)
        return self if data == self.model_dump() else parse_config(data, source)


def apply_overrides(data: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` (a config as a mapping) with dotted-key overrides set in it, the two shard sizes as
    ``ShardingConfig.size_changes`` takes them; validated by whoever parses the result, once."""
    overrides = dict(overrides)
    sizes = {k: overrides[f"sharding.{k}"] for k in SHARD_SIZES if f"sharding.{k}" in overrides}
    current = data.get("sharding") or {}
    overrides.update({f"sharding.{k}": v for k, v in ShardingConfig.size_changes(current, sizes).items()})
    for dotted, value in overrides.items():
        node = data
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return data


class ConfigDump(dict[str, Any]):
    """A validated config's JSON dump (what an operator's argument carries into the serialized DAG) that keeps
    the config it was made from, so that an operator made in the same process (the DAG file's parse in a task's
    process) takes that config instead of validating the dump again. A copy that lost it (JSON, a plain dict) is
    parsed as any dump. Not to be changed: change the config (``with_overrides``) and dump that."""

    def __init__(self, config: PipelineConfig):
        super().__init__(config.model_dump(mode="json"))
        self.config = config


def _format_errors(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = _unknown_key(e["loc"]) if e["type"] == "extra_forbidden" else e["msg"]
        lines.append(f"{source}: {key}: {msg}")
    return "\n".join(lines)


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The config model a field holds (itself, a list's items, an optional's value)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        if found := _model_in(arg):
            return found
    return None


def _section_model(parents: tuple) -> type[BaseModel] | None:
    cls: type[BaseModel] | None = PipelineConfig
    for part in parents:
        if isinstance(part, int):  # a list's item: the list's field already gave its model
            continue
        field = cls.model_fields.get(part) if cls else None
        cls = _model_in(field.annotation) if field else None
    return cls


def _unknown_key(loc: tuple) -> str:
    """A typo'd key: where it is, the closest valid key of that section, or where a key of that name lives."""
    *parents, name = loc
    section = ".".join(str(p) for p in parents)
    where = f"in section {section!r}" if section else "at the top level"
    cls = _section_model(tuple(parents))
    if cls is None:
        return f"unknown key {name!r} {where}"
    valid = list(cls.model_fields)
    close = difflib.get_close_matches(str(name), valid, n=1)
    if close:
        return f"unknown key {name!r} {where}; did you mean {close[0]!r}?"
    elsewhere = [s for s, f in PipelineConfig.model_fields.items()
                 if (m := _model_in(f.annotation)) and name in m.model_fields and m is not cls]
    if elsewhere:
        return f"unknown key {name!r} {where}; it is a key of section {elsewhere[0]!r} ({elsewhere[0]}.{name})"
    return f"unknown key {name!r} {where}; the keys there: {', '.join(valid)}"


def parse_config(data: Any, source: str = "<config>") -> PipelineConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level, got {type(data).__name__}")
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_errors(e, source)) from None


def load_config(path: str | os.PathLike) -> PipelineConfig:
    """Reads and validates one pipeline YAML file. Relative paths inside it resolve against its folder.

    Local word-list files are checked here, so a missing one stops the run before any inference (lists in
    object storage are checked when the filter stage starts)."""
    path = Path(path)
    try:  # bounded: a huge file, a device or an alias bomb costs one line, not the memory of whoever loads it
        data = path_policy.load_yaml(path_policy.read_local_bounded(str(path), path_policy.MAX_PIPELINE_FILE_BYTES)
                                     .decode("utf-8"))
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except ValueError as e:  # path_policy.PathRefused, or the YAML expands too far
        raise ConfigError(f"{path}: {e}") from None
    if isinstance(data, dict):
        data = _resolve_relative_paths(data, path.parent)
    cfg = parse_config(data, str(path))
    problems = word_list_problems(cfg.filter) if cfg.filter.enabled else []
    if problems:
        raise ConfigError("\n".join(f"{path}: {p}" for p in problems))
    return cfg


def word_list_problems(cfg: FilterConfig) -> list[str]:
    """Word lists that cannot be read: an unknown built-in, a local path that is not a regular file (missing, a
    device, a FIFO) or over ``path_policy.MAX_WORD_LIST_BYTES`` (object-storage paths are not looked at: that
    needs credentials, and the filter stage checks them when it starts)."""
    problems = []
    for i, wl in enumerate(cfg.lists):
        where = f"filter.lists.{i}.path: word list {wl.name!r}"
        resolved = path_policy.resolve(wl.path)
        if resolved.kind == "builtin":
            try:
                path_policy.builtin_file(wl.path)
            except path_policy.PathRefused as e:
                problems.append(f"{where}: {e}")
        elif resolved.kind == "local" and resolved.local_path:
            problem = path_policy.local_file_problem(resolved.local_path, path_policy.MAX_WORD_LIST_BYTES)
            if problem:
                problems.append(f"{where}: {problem} (give an existing file of one word per line, "
                                f"or builtin:en / builtin:zh)")
    return problems


_PATH_KEYS = (("input", "path"), ("output", "path"), ("model", "ref"), ("model", "cache_dir"),
              ("cache", "path"), ("quantize", "cache_dir"), ("sampling", "output_schema"))


def _resolve_relative_paths(data: dict, base: Path) -> dict:
    def fix(value: Any) -> Any:
        if isinstance(value, str) and value.startswith(("./", "../")):
            return str((base / value).resolve())
        return value

    for section, key in _PATH_KEYS:
        if isinstance(data.get(section), dict) and key in data[section]:
            data[section][key] = fix(data[section][key])
    for wl in (data.get("filter") or {}).get("lists") or []:
        if isinstance(wl, dict) and "path" in wl:
            wl["path"] = fix(wl["path"])
    roots = (data.get("input") or {}).get("image_roots") if isinstance(data.get("input"), dict) else None
    if isinstance(roots, list):
        data["input"]["image_roots"] = [fix(r) for r in roots]
    review = (data.get("filter") or {}).get("review")
    if isinstance(review, dict) and isinstance(review.get("model"), dict):
        for key in ("ref", "cache_dir"):
            if key in review["model"]:
                review["model"][key] = fix(review["model"][key])
    return data
