"""The ``engine`` section: the engine's kind and parameters, with its own sub-sections (memory back-off, speculative
decoding, the embed and classify tasks); each key is checked against the engine's row of the capability table
(``capabilities.py``), so a key the engine would not honour is refused when the config loads."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from batch_llm.config.capabilities import (
    DEFAULT_KIND,
    ENGINES,
    EngineCapabilities,
    capabilities,
    engines_serving,
    missing_package,
    who_can,
)
from batch_llm.config.precision import Precision, PrecisionGateConfig
from batch_llm.config.section import ConfigError, Section
from batch_llm.config.sglang import SglangSettings


class EngineNotInstalled(ConfigError):
    """The engine a command would start here is not installed here (``require_engine_installed``)."""


def require_engine_installed(kind: str, python: str | None = None, *, chosen_by: str = "engine.kind") -> None:
    """Refuses, before any work, an engine whose package this interpreter lacks, naming the extra and
    ``engine.python``. Not a check of config loading: a scheduler or a DAG parser loads configs of engines that
    run on other machines; the commands that start the engine in this process tree call it (``chosen_by``: the
    key or flag that chose the kind, as the message names it)."""
    if problem := missing_package(kind, python):
        raise EngineNotInstalled(f"{chosen_by} {kind}: {problem}")


class MemoryBackoffConfig(Section):
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


class SpeculativeConfig(Section):
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


class EmbedConfig(Section):
    """Settings of ``engine.task: embed`` (vLLM's pooling runner; PoolingParams of vLLM 0.32)."""

    normalize: bool = Field(True, description="L2-normalize every vector (vLLM's use_activation for embed)")


class ClassifyConfig(Section):
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
    ("replicas", "replicas", "several engines of one shard side by side, each in an engine-core process"),
    ("torch_compile", "torch_compile", "vLLM's compilation mode"),
    ("compile_cache", "compile_cache", "vLLM's compilation cache"),
    ("precision", "precision_gate", "the precision gate (a greedy sample in both precisions)"),
    ("tensor_parallel_size", "tensor_parallel", "the model split over that many GPUs"),
    ("limit_mm_per_prompt", "images", "images per prompt, of an engine that takes images"),
    ("mm_processor_kwargs", "images", "the image processor's settings, of an engine that takes images"),
)


class EngineConfig(Section):
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
    replicas: int = Field(
        1, ge=1, le=8, description="vLLM: engines the shard runs side by side on its GPU(s), each with "
        "gpu_memory_utilization / replicas of the memory (memory_backoff's min_gpu_memory_utilization and "
        "gpu_memory_utilization_step scaled the same way). The first starts as one engine would (back-off, probe, "
        "precision: auto's gate), the others one after another, once, with the settings it ended with; one that "
        "does not start is left out (replicas_started in the manifest's engine settings). Each request goes to the "
        "asking replica with the fewest in flight; the rows are the same as with one engine. For a small model whose "
        "GPU sits partly idle while one engine core does its CPU work; each engine core needs a process of its own "
        "(engine.multiprocessing: false is refused; on a CPU, where it defaults to in-process, set it to true)")
    replica_start: Literal["beside", "before"] = Field(
        "beside", description="engine.replicas > 1: when the replicas after the first start. beside: one after "
        "another in the background while the first generates, each joining the shard's request stream once it is "
        "up, so the shard waits for one engine start, not replicas of them (a start and generation share the GPU "
        "for the seconds it overlaps); before: all of them before generation begins")
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
    def _replicas_need_engine_core_processes(self) -> "EngineConfig":
        # in-process engine cores would share this one Python process: their CPU work could not overlap
        if self.replicas > 1 and self.multiprocessing is False:
            raise ValueError(f"engine.replicas: {self.replicas} overlaps one engine's CPU work with another's GPU work, "
                             "which needs each engine core in a process of its own; engine.multiprocessing is false "
                             "(remove it, or set engine.replicas: 1)")
        return self

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
        if not self.caps.precision_gate:
            return self  # refused by _every_key_honored, naming the engines that have it
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
