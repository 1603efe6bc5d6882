"""Batch inference over one shard: resumable, exactly once, per-row errors, progress, metrics, a timeline.

How a shard is run (``ShardRun``, one method per step)::

    read      rows (streamed) ─> request key = chat or token ids (+ row max_tokens); the chat template and
              the sampling are in the cache namespace; identical prompts fold into one request
              └> cache lookup (streamed) ─> hits become committed results without the engine or a tokenizer
    engine    if anything is left: the engine starts (in a thread of its own with OVERLAP_ENGINE_START, off:
              see there), and meanwhile
    tokenize  rows (streamed again) ─> chat template + tokenizer ─> a local spool of requests; rows that cannot
              become one (the template rejects the chat, the prompt is longer than the context) are error rows
    generate  spooled requests, then the rest of the rows ─> engine (streamed) ─> chunks committed as results
              finish
    merge     committed chunks ─> outputs.jsonl / errors.jsonl (``shard_merge``) ─> cache table ─> manifest

A task of several shards (``sharding.shards_per_task``) runs them in turn on one engine (``SharedEngine``):
the first that generates starts it, the others find it started. Committed chunks are immutable files under
``<shard>/chunks/``; a retry reads them, skips every committed
row id and generates only the rest. ``manifest.json`` is written last. Each phase's wall-clock interval goes
into the manifest (``phases``, see ``timeline.py``): the report draws them, the doctor names the largest.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, NamedTuple

from batch_llm.analysis.timeline import Timeline
from batch_llm.cache.lookup import Lookup
from batch_llm.cache.results import ResultCache, namespace, prompt_key
from batch_llm.config import PipelineConfig, SamplingConfig
from batch_llm.engines.base import Engine, EngineCannotRun, EngineInfo, GenRequest, GenResult
from batch_llm.engines.start import start_engine
from batch_llm.host.probes import model_chat_template
from batch_llm.io.identity import ENGINE_FIELDS_NOT_IN_OUTPUT, OUTPUT_IDENTITY_FORMAT, engine_dtype
from batch_llm.io.storage import (
    Location,
    exists,
    iter_jsonl,
    json_bytes,
    list_files,
    peak_rss_mb,
    read_json,
    remove_tree,
    write_json,
    write_jsonl,
)
from batch_llm.manifests import (
    EngineRecord,
    FetchManifest,
    ModelRef,
    Phase,
    PlanManifest,
    QuantizeManifest,
    ShardManifest,
    ShardSpec,
)
from batch_llm.output_schema import OutputSchema
from batch_llm.reasoning import (
    TemplateThinking,
    ThinkingRefused,
    resolved_reasoning_parser,
    template_kwargs_problem,
    template_thinking,
    thinking_variables,
)
from batch_llm.rows.params import RowParams, resolve, response_schema, template_kwargs
from batch_llm.stages.shard_merge import committed_ids, finish_shard

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

from batch_llm.layout import RunLayout

log = logging.getLogger("batch_llm.stages.infer")


class ShardFailed(RuntimeError):
    """The shard finished but too many rows failed; its outputs and errors were still written."""


# The shard's checkpoints, announced as audit events: free when nobody listens; the resume tests listen
# (tests/fault_injection) and kill the worker there. No fault injection lives in this package.
CHECKPOINT_EVENT = "batch_llm.shard.checkpoint"


def checkpoint(point: str, where: str = "") -> None:
    """``where``: the shard's folder, so that a listener can pick one run's shards among a service's many."""
    sys.audit(CHECKPOINT_EVENT, point, where)


# ------------------------------------------------------------------------------------------ helpers
@dataclass
class Progress:
    total: int
    say: Callable[[str], None]
    every: float
    done: int = 0
    out_tokens: int = 0
    t0: float = field(default_factory=time.perf_counter)
    last: float = field(default_factory=time.perf_counter)

    def tick(self, rows: int, out_tokens: int, force: bool = False) -> None:
        self.done += rows
        self.out_tokens += out_tokens
        now = time.perf_counter()
        if force or now - self.last >= self.every:
            self.last = now
            el = max(now - self.t0, 1e-9)
            rate = self.done / el
            eta = (self.total - self.done) / rate if rate > 0 else float("inf")
            self.say(f"progress: {self.done}/{self.total} rows, {self.out_tokens / el:.1f} output tok/s, "
                     f"ETA {eta:.0f}s")


def chat_template_text(model_dir: str, override: str | None) -> str:
    """The chat template the tokenizer will use, read from the model's files (no tokenizer load)."""
    return override or model_chat_template(model_dir)


def load_tokenizer(model_dir: str, chat_template: str | None, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    if chat_template:
        tok.chat_template = chat_template
    return tok


def _prompt_basis(r: dict) -> list:
    """What the prompt is, for its key: token ids, a completion text or a chat."""
    if "prompt_token_ids" in r:
        return ["ids", r["prompt_token_ids"]]
    return ["text", r["text"]] if "text" in r else ["chat", r["messages"]]


def _row_params(r: dict) -> dict | None:
    """The shard row's own sampling parameters (``max_tokens`` alone in shards planned before row params)."""
    if "params" in r:
        return r["params"]
    return {"max_tokens": r["max_tokens"]} if r.get("max_tokens") else None


def _spool_line(req: GenRequest) -> bytes:
    """A request on local disk: its images by reference (loaded again when it goes to the engine)."""
    params = req.params.to_json() if req.params is not None else None
    return json_bytes([req.key, req.prompt_token_ids, req.prompt_text, params, req.image_refs]) + b"\n"


def _spooled_requests(path: Path) -> Iterator[GenRequest]:
    for key, ids, text, params, *refs in iter_jsonl(path):
        yield GenRequest(key=key, prompt_token_ids=ids, prompt_text=text, params=RowParams.from_json(params),
                         image_refs=refs[0] if refs else None)


class _RequestSpool:
    """Requests kept for later on local disk (a shard's invalid outputs can be many; their prompts are not
    held in memory)."""

    def __init__(self, path: Path):
        self.path, self.count = path, 0
        self._fh: BinaryIO | None = None

    def add(self, req: GenRequest) -> None:
        if self._fh is None:
            self._fh = open(self.path, "wb")
        self._fh.write(_spool_line(req))
        self.count += 1

    def close(self) -> "_RequestSpool":
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        return self

    def read(self) -> Iterator[GenRequest]:
        return _spooled_requests(self.path) if self.count else iter(())


class RequestKey(NamedTuple):
    """What a request is: its content key (also the cache key) and, when identical prompts are not folded
    into one request, the row it is for. ``request_id`` is the string the engine carries."""

    content: str
    row_id: str | None = None

    @property
    def request_id(self) -> str:
        return self.content if self.row_id is None else f"{self.content}#{self.row_id}"


@dataclass
class _Group:
    """The rows (id, idx) that one request's result answers."""

    key: RequestKey
    rows: list[tuple[str, int]] = field(default_factory=list)


# A result's fields beyond the first sample, present only where the request asked for them: every sample's
# text and finish reason (n > 1), the log-probabilities of the first sample's tokens and of every sample's.
# Chunks, outputs.jsonl and cache entries carry them as they are, so a resumed shard or a cache hit loses none.
SAMPLE_FIELDS = ("outputs", "finish_reasons", "logprobs", "outputs_logprobs")
# engine.task embed: the row's vector; classify: its top class and every class's probability. Carried like the
# sample fields (chunks, outputs.jsonl, cache entries).
# A reasoning model's thinking, parted from the answer by the engine's reasoning parser (engine.reasoning_parser):
# the first sample's thinking, its tokens (every sample's), whether it ended, the budget it ran under, and every
# sample's thinking (n > 1). Carried like the sample fields.
REASONING_FIELDS = ("reasoning", "reasoning_tokens", "thinking_ended", "max_thinking_tokens", "outputs_reasoning")
RESULT_FIELDS = (*SAMPLE_FIELDS, "embedding", "label", "scores", *REASONING_FIELDS)


def sample_fields(res: GenResult) -> dict:
    """The result's ``SAMPLE_FIELDS`` (JSON-ready): ``outputs`` / ``finish_reasons`` where it has several
    samples, ``logprobs`` (the first sample's, as ``output`` is the first's) and ``outputs_logprobs`` where
    log-probabilities were asked for."""
    samples = res.samples or ()
    out: dict = {}
    if len(samples) > 1:
        out["outputs"] = [s.text for s in samples]
        out["finish_reasons"] = [s.finish_reason for s in samples]
    if samples and samples[0].logprobs is not None:
        out["logprobs"] = [dataclasses.asdict(t) for t in samples[0].logprobs]
        if len(samples) > 1:
            out["outputs_logprobs"] = [[dataclasses.asdict(t) for t in s.logprobs or ()] for s in samples]
    return out


def _reasoning_fields(res: GenResult) -> dict:
    """The result's ``REASONING_FIELDS``, where the engine parted thinking from answer (none otherwise)."""
    if res.thinking_ended is None:
        return {}
    out: dict = {"reasoning": res.reasoning, "reasoning_tokens": res.reasoning_tokens,
                 "thinking_ended": res.thinking_ended}
    if res.thinking_budget is not None:
        out["max_thinking_tokens"] = res.thinking_budget
    if res.samples and len(res.samples) > 1:
        out["outputs_reasoning"] = [s.reasoning for s in res.samples]
    return out


def unfinished_thinking(res: GenResult) -> str | None:
    """Why a row under a schema has no answer to check: its thinking never ended (the grammar waits for the end
    of the thinking, so nothing was decoded under it); None where it ended or there was none."""
    if res.thinking_ended is not False:
        return None
    return (f"thinking never ended: {res.reasoning_tokens} thinking tokens ran to the end of the output "
            f"(finish_reason {res.finish_reason}) before an answer under the schema began; raise max_tokens or set "
            "sampling.max_thinking_tokens")


def result_row(r: tuple[str, int], entry: dict, *, cached: bool, key: str) -> dict:
    return {"id": r[0], "idx": r[1], "output": entry["output"], "finish_reason": entry["finish_reason"],
            "prompt_tokens": entry["prompt_tokens"], "completion_tokens": entry["completion_tokens"],
            "cached_prompt_tokens": 0 if cached else entry.get("cached_prompt_tokens", 0),
            "cached": cached, "error": None, "key": key, **{k: entry[k] for k in RESULT_FIELDS if k in entry}}


def _error_row(r: tuple[str, int], reason: str, prompt_tokens: int = 0) -> dict:
    return {"id": r[0], "idx": r[1], "output": None, "finish_reason": None, "prompt_tokens": prompt_tokens,
            "completion_tokens": 0, "cached": False, "error": reason}


def _invalid_row(r: tuple[str, int], res: GenResult, reason: str) -> dict:
    """An output that does not match ``sampling.output_schema``: kept (with its text) as an error row of its
    own kind, which ``engine.max_error_rate`` does not count: the engine worked, the answer did not fit."""
    return {"id": r[0], "idx": r[1], "output": res.text, "finish_reason": res.finish_reason,
            "prompt_tokens": res.prompt_tokens, "completion_tokens": res.completion_tokens,
            "cached_prompt_tokens": res.cached_prompt_tokens, "cached": False,
            "error": reason, "error_kind": "invalid_output", **sample_fields(res), **_reasoning_fields(res)}


# Off: in a clean-clone CI run, the engine thread's first import of vLLM (transformers, accelerate) raced the
# main thread's tokenizer import ("cannot import name 'AlignDevicesHook' from partially initialized module
# 'accelerate.hooks'"), which broke every later engine start in that process. The engine then starts first,
# as before; overlapping it needs the imports done in the main thread beforehand (not yet tested). It would
# save little: after vLLM's import the tokenizer loads in ~0.4 s and renders ~0.15 ms a chat row (2-core CPU).
OVERLAP_ENGINE_START = False


class _EngineStarter(threading.Thread):
    """Starts the engine (imports, memory back-off, probe) while the caller tokenizes: engine start is mostly
    waiting on the engine's own processes, so the two overlap instead of adding up."""

    def __init__(self, model_dir: str, cfg: PipelineConfig, say: Callable[[str], None], timeline: Timeline,
                 lora_dir: str | None = None, storage_options: dict | None = None):
        super().__init__(name="engine-start", daemon=True)
        self.model_dir, self.cfg, self.say, self.timeline = model_dir, cfg, say, timeline
        self.lora_dir = lora_dir
        self.storage_options = storage_options  # engine.compile_cache's store: the output's
        self.engine: Engine | None = None
        self.info: EngineInfo | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        t0 = time.time()
        try:
            self.engine, self.info = start_engine(self.model_dir, with_reasoning_parser(self.cfg, self.model_dir),
                                                  self.say, lora_dir=self.lora_dir,
                                                  storage_options=self.storage_options)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread by result()
            self.error = e
        self.timeline.add("engine", t0)

    def result(self):
        if self.ident is not None:  # started as a thread (else run() already ran in the caller's thread)
            self.join()
        if self.error is not None:
            raise self.error
        return self.engine, self.info


class SharedEngine:
    """One engine for the consecutive shards one task runs in turn (``sharding.shards_per_task``): started by
    the first shard that needs one (its timeline gets the ``engine`` phase, its manifest the start's seconds),
    used as it is by the later ones (their ``engine_start_seconds`` is 0 and ``engine_shared_from`` names the
    shard that paid), closed by the caller once the last shard is done (``stages.infer_shards``). A shard that
    is already committed, or served whole from the result cache, starts nothing: the next one that generates
    pays the start."""

    def __init__(self) -> None:
        self.engine: Engine | None = None
        self.info: EngineInfo | None = None
        self.started_by: int | None = None   # the shard whose start it was
        self.starts = 0

    def get(self, run: "ShardRun") -> tuple[Engine, EngineInfo]:
        if self.engine is None:
            starter = _EngineStarter(run.model_dir, run.cfg, run.say, run.timeline, lora_dir=run.lora_dir,
                                     storage_options=run.shard_dir.options)
            starter.run()  # in this thread: the shard's rows are rendered as the engine takes them
            self.engine, self.info = starter.result()
            self.started_by, self.starts = run.shard.index, self.starts + 1
            run.say(f"engine {self.info.kind} {self.info.version} started in {self.info.start_seconds:.1f}s: "
                    f"{self.info.settings}")
        else:
            run.say(f"shard {run.shard.index}: the engine shard {self.started_by} started serves it too")
        assert self.info is not None
        return self.engine, self.info

    def paid_by(self, index: int) -> bool:
        return self.started_by == index

    def close(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.close()


# ------------------------------------------------------------------------------------------ the shard
class ShardRun:
    """One shard, run to completion or resumed; ``run()`` returns its manifest.

    ``shard`` is the planner's entry (``ShardSpec``: index, rows, the shard file's url). ``started`` carries the
    worker's own clock (``spawned_at``, ``worker_started_at``, epoch seconds) for the timeline. ``on_committed``
    is called with the manifest once it is durable and the shard passed its error-rate check, before the engine
    is shut down: the worker reports there and ends its engine's processes itself (``batch_llm.isolation.worker_parent``).
    ``shared_engine``: the engine of the task's shards (``SharedEngine``), which the shard neither starts when
    another did nor closes."""

    def __init__(self, cfg: PipelineConfig, *, shard: ShardSpec, shard_dir: Location, model_dir: str, model_key: str,
                 cache_root: Location | None = None, say: Callable[[str], None] = print,
                 started: dict | None = None, lora_dir: str | None = None,
                 on_committed: Callable[[ShardManifest], None] | None = None,
                 shared_engine: SharedEngine | None = None, image_options: dict | None = None):
        self.cfg, self.shard, self.shard_dir, self.say = cfg, shard, shard_dir, say
        self.image_options = image_options or {}  # the input's storage options: its rows' images are read with them
        self.on_committed = on_committed
        self.shared = shared_engine
        self.engine: Engine | None = None
        self.model_dir, self.model_key, self.lora_dir = model_dir, model_key, lora_dir
        self.shard_path = Location(shard.url, shard_dir.options).path()
        self.chunks_dir = shard_dir.child("chunks")
        self.timeline = Timeline()
        self._record_start(started or {})
        self.dedupe = cfg.engine.dedupe_prompts and (cfg.sampling.temperature == 0 or cfg.sampling.seed is not None)
        self.cache = self._open_cache(cache_root)
        self.groups: dict[str, _Group] = {}    # request_id -> the rows its result answers
        self.sent_by: dict[str, str] = {}       # row id -> request_id, for the row whose prompt is sent
        self.pending: list[dict] = []
        self.chunk_seq = len(list_files(self.chunks_dir.path(), ".jsonl"))
        self.last_commit = time.perf_counter()
        self.n_rows = self.n_cached = self.gen_tokens = 0
        self.gen_seconds = 0.0
        self.tokenizer: PreTrainedTokenizerBase | None = None
        self.lookup: Lookup | None = None
        self.info: EngineInfo | None = None
        schema = cfg.sampling.output_schema
        self.schema = OutputSchema(schema) if schema is not None else None
        self.row_formats: dict[str, str] = {}  # request_id -> its row's own response_format (OpenAI bodies)
        self._row_schemas: dict[str, OutputSchema] = {}  # response_format -> its compiled schema
        self.retryable: dict[str, GenRequest] = {}  # in flight, kept while an invalid output may be asked again
        self.retry: _RequestSpool | None = None   # invalid outputs to ask again (on local disk, not in memory)
        self.n_retried = 0
        # guided_decoding: fallback: the first pass decodes freely, the misses once more under the schema
        self.fallback = self.schema is not None and cfg.sampling.guided_decoding == "fallback"

    def _record_start(self, started: dict) -> None:
        now = time.time()
        if started.get("spawned_at") and started.get("worker_started_at"):
            self.timeline.add("spawn", started["spawned_at"], started["worker_started_at"])
        if started.get("worker_started_at"):
            self.timeline.add("imports", started["worker_started_at"], now)

    def _open_cache(self, root: Location | None) -> ResultCache | None:
        if root is None or not self.cfg.cache.enabled:
            return None
        ns = namespace(output_identity(self.cfg, model_key=self.model_key, model_dir=self.model_dir))
        return ResultCache(root, ns, max_age_days=self.cfg.cache.max_age_days)

    # ---------------------------------------------------------------------------------- the steps
    def run(self) -> ShardManifest:
        t_start = time.perf_counter()
        if manifest := ShardManifest.read_if_done(self.shard_dir.path()):
            self.say(f"shard {self.shard.index} already committed: {manifest.metrics.rows} rows; nothing to do")
            check_error_rate(self.cfg, manifest)
            return self._committed(manifest)
        self.timeline.begin("read")
        done = committed_ids(self.chunks_dir)
        if done:
            self.say(f"resuming shard {self.shard.index}: {len(done)} rows already committed")
        self.progress = Progress(total=0, say=self.say, every=self.cfg.engine.progress_every_seconds)
        self._read_requests(done)
        self.progress.total, self.progress.done = self.n_rows, len(done)
        self._serve_cache()
        self.timeline.end("read")
        # The engine shuts down after the manifest is written, not before: the outputs are durable ~1 s (vLLM's
        # shutdown handshake) sooner, and the worker need not wait for it at all (on_committed).
        try:
            if self.groups:
                self._generate()
            self._commit(force=True)
            self.progress.tick(0, 0, force=True)
            return self._committed(self._finish(t_start))
        finally:
            if self.engine is not None:
                self.engine.close()
                self.engine = None

    def _committed(self, manifest: ShardManifest) -> ShardManifest:
        if self.on_committed is not None:
            self.on_committed(manifest)
        return manifest

    def _read_requests(self, done: set[str]) -> None:
        """The keys pass: streams the shard once, holding a few small fields per row (not the prompts)."""
        for r in iter_jsonl(self.shard_path):
            self.n_rows += 1
            if r["id"] in done:
                continue
            key = RequestKey(prompt_key(_prompt_basis(r), _row_params(r)), None if self.dedupe else r["id"])
            group = self.groups.get(key.request_id)
            if group is None:
                group = self.groups[key.request_id] = _Group(key)
                self.sent_by[r["id"]] = key.request_id
            group.rows.append((r["id"], r["idx"]))
            if (params := _row_params(r)) and params.get("response_format"):
                own = RowParams.from_json(params)  # its response_format as canonical JSON text
                if own is not None and own.response_format is not None:
                    self.row_formats[key.request_id] = own.response_format
        self.n_prompts = len({g.key.content for g in self.groups.values()})

    def _serve_cache(self) -> None:
        """Cache hits first: they cost nothing (no engine, no tokenizer)."""
        if self.cache is None:
            return
        by_content: dict[str, list[str]] = {}
        for rid, g in self.groups.items():
            by_content.setdefault(g.key.content, []).append(rid)
        self.lookup = lookup = self.cache.lookup(by_content)  # streamed: each key found, once
        for hit in lookup:
            for rid in by_content[hit["key"]]:
                for r in self.groups.pop(rid).rows:
                    self.pending.append(result_row(r, hit, cached=True, key=hit["key"]))
                    self.n_cached += 1
                    self.progress.tick(1, 0)
            self._commit()
        self.say(f"cache: {self.n_cached} rows cached; lookup {lookup.stats}")
        self._commit()

    def _generate(self) -> None:
        starter = None
        if self.shared is None:
            starter = _EngineStarter(self.model_dir, self.cfg, self.say, self.timeline, lora_dir=self.lora_dir,
                                     storage_options=self.shard_dir.options)
            if OVERLAP_ENGINE_START and self.cfg.engine.caps.overlap_engine_start:  # LMDeploy binds its thread's loop
                starter.start()
            else:
                starter.run()
        rows = iter_jsonl(self.shard_path)
        with tempfile.TemporaryDirectory(prefix="batch_llm_requests_") as tmp:
            self.retry = _RequestSpool(Path(tmp) / "retry-0.jsonl")
            spooled = None
            if starter is not None:
                spooled = self._tokenize_while(starter.is_alive, rows, Path(tmp) / "requests.jsonl")
                engine, self.info = starter.result()
                self.engine = engine  # closed by run(), once the manifest is written
                self.say(f"engine {self.info.kind} {self.info.version} started in {self.info.start_seconds:.1f}s: "
                         f"{self.info.settings}")
            else:
                assert self.shared is not None
                engine, self.info = self.shared.get(self)  # closed by its owner, after the task's last shard
            t_gen, t0 = time.perf_counter(), time.time()
            self.progress.t0 = self.progress.last = t_gen  # rates and ETA count generation, not engine start
            first = None
            try:
                for res in engine.generate(self._requests(spooled, rows)):
                    if first is None:
                        first = time.time()
                        self.timeline.add("first_token", t0, first)
                    self._take(res)
                attempts = self.cfg.sampling.output_retries + self.fallback
                for attempt in range(1, attempts + 1):
                    if not self.retry.count:
                        break
                    again, self.retry = self.retry.close(), _RequestSpool(Path(tmp) / f"retry-{attempt}.jsonl")
                    self.n_retried += again.count
                    self.say(f"asking again for {again.count} invalid outputs (attempt {attempt + 1}"
                             f"{', under the schema' if self.fallback else ''})")
                    for res in engine.generate(self._retry_requests(again.read(), attempt)):
                        self._take(res, last=attempt == attempts)
            finally:
                self.gen_seconds = time.perf_counter() - t_gen
                self.timeline.add("generation", first or t0)

    def _tokenize_while(self, engine_starting: Callable[[], bool], rows: Iterator[dict], spool: Path) -> Path | None:
        """Renders requests into a local spool for as long as the engine is starting; the rest are rendered
        as the engine takes them."""
        if not engine_starting():
            return None
        t0 = time.time()
        with open(spool, "wb") as fh:
            for r in rows:
                req = self._request_for(r)
                if req is not None:
                    fh.write(_spool_line(req))
                if not engine_starting():
                    break
        self.timeline.add("tokenize", t0)
        return spool

    def _requests(self, spooled: Path | None, rows: Iterator[dict]) -> Iterator[GenRequest]:
        """Every request still to generate, in the planner's order: the spooled ones, then the rest. A request's
        images are loaded here, as the engine pulls it, on ``input.image_workers`` threads a bounded window ahead
        (``io.images.load_ahead``; each as ``_with_images`` says): only the requests the engine holds at once and
        that window have decoded images, never the shard's."""
        from batch_llm.io.images import ImageProblem, decoded_bytes, load_ahead

        inp = self.cfg.input
        for req, images in load_ahead(self._first_requests(spooled, rows), lambda r: r.image_refs or (),
                                      self._load_image, inp.image_workers,
                                      cost=lambda r: decoded_bytes(r.image_refs or (), inp.max_image_pixels),
                                      budget=inp.max_decoded_bytes_ahead):
            if isinstance(images, ImageProblem):
                self._fail(req.key, str(images))
                continue
            if self._may_retry(req):
                self.retryable[req.key] = req  # by reference: an asked-again request loads its images again
            yield req if images is None else dataclasses.replace(req, images=images)

    def _with_images(self, req: GenRequest) -> GenRequest | None:
        """The request with its images decoded (``io.images.load_image``: read again, its content hash compared
        with the plan's, decoded in full with PIL); None, its rows failed with the reason, where one cannot be
        (gone or changed since the plan, corrupt past its header). Whether this engine and model take images was
        asked when the request was made (``_request_for``: every request, spooled or asked again, comes from it)."""
        if not req.image_refs:
            return req
        from batch_llm.io.images import ImageProblem

        try:
            images = [self._load_image(ref) for ref in req.image_refs]
        except ImageProblem as e:
            self._fail(req.key, str(e))
            return None
        return dataclasses.replace(req, images=images)

    def _load_image(self, ref: dict) -> Any:
        """One image of a request, loaded under the input's limits and read from where its plan may read
        (``io.images.load_image``)."""
        from batch_llm.host import path_policy
        from batch_llm.io.images import load_image

        inp = self.cfg.input
        return load_image(ref, self.image_options, inp.max_image_bytes, max_pixels=inp.max_image_pixels,
                          stores=path_policy.input_stores(inp.path, inp.conn_id))

    def _image_refusal(self, n: int) -> str | None:
        """Why this shard's engine or model cannot take a request's ``n`` images (a review pass's rows meet the
        review model's engine here), or None."""
        from batch_llm.config.capabilities import takes_no_images

        if why := takes_no_images(self.cfg.engine.kind):
            return f"the row has {n} image(s): {why} (a review: or filter.review.images: text)"
        if not self._model_takes_images:
            return (f"the row has {n} image(s): the model at {self.model_dir} takes no images (its config.json names "
                    "no vision part); use a vision-language model (a review: or filter.review.images: text)")
        return None

    @functools.cached_property
    def _model_takes_images(self) -> bool:
        from batch_llm.io.images import model_takes_images

        return model_takes_images(self.model_dir)

    def _first_requests(self, spooled: Path | None, rows: Iterator[dict]) -> Iterator[GenRequest]:
        if spooled is not None:  # rendered while the engine started: a back-off may have shortened the context since
            yield from (req for req in _spooled_requests(spooled) if not self._too_long(req.key, req.prompt_token_ids))
        for r in rows:
            req = self._request_for(r)
            if req is not None:
                yield req

    def _may_retry(self, req: GenRequest) -> bool:
        """An invalid output is asked again where that can change it: under guided_decoding: fallback every row
        (its first pass was free), otherwise a sampled row (another seed) under output_retries."""
        return self.fallback or (self._schema_of(req.key) is not None and self.cfg.sampling.output_retries > 0
                                 and resolve(req.params, self.cfg.sampling).temperature > 0)

    def _request_for(self, r: dict) -> GenRequest | None:
        """The request of the row whose prompt is sent; rows that cannot become one are error rows."""
        rid = self.sent_by.get(r["id"])
        if rid is None or rid not in self.groups:
            return None
        if r.get("images") and (refusal := self._image_refusal(len(r["images"]))):  # before a text template sees them
            self._fail(rid, refusal)
            return None
        try:
            text, ids = self._render(r)
        except ThinkingRefused as e:  # the row's thinking setting, which this model's template cannot honour
            self._fail(rid, str(e))
            return None
        except Exception as e:  # noqa: BLE001 - a template that rejects the chat is a row error
            self._fail(rid, f"chat template failed: {e}")
            return None
        if self._too_long(rid, ids):
            return None
        return GenRequest(key=rid, prompt_token_ids=ids, prompt_text=text,
                          params=RowParams.from_json(_row_params(r)), image_refs=r.get("images") or None)

    def _too_long(self, rid: str, ids: list[int]) -> bool:
        """Fails the request's rows when its prompt leaves no room in the context the engine has: a row error
        with its reason, where the engine would fail the shard."""
        max_len = self._context_limit()
        if not max_len or len(ids) < max_len:
            return False
        configured = self.cfg.engine.max_model_len
        lowered = " (lowered from engine.max_model_len by memory back-off)" if configured and max_len < configured else ""
        self._fail(rid, f"prompt is {len(ids)} tokens; the context (max_model_len) is {max_len}{lowered}", len(ids))
        return True

    def _context_limit(self) -> int | None:
        """engine.max_model_len, or, once the engine started, the context it started with: a memory back-off
        may have lowered it (the engine's own figure counts where it reports one)."""
        limits = [self.cfg.engine.max_model_len]
        if self.info is not None:
            limits += [getattr(getattr(self.info, "config", None), "max_model_len", None),
                       self.info.settings.get("max_model_len")]
        known = [x for x in limits if isinstance(x, int) and x > 0]
        return min(known) if known else None

    def _render(self, r: dict) -> tuple[str, list[int]]:
        if "prompt_token_ids" in r:  # pre-tokenized rows need no tokenizer
            return "", r["prompt_token_ids"]
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(self.model_dir, self.cfg.model.chat_template,
                                             self.cfg.model.trust_remote_code)
        if "text" in r:  # a completion prompt: tokenized as vLLM's completions API does (special tokens added)
            return r["text"], self.tokenizer(r["text"], add_special_tokens=True)["input_ids"]
        if not self.tokenizer.chat_template:
            raise ValueError(f"the model at {self.model_dir} has no chat template; set model.chat_template")
        variables = template_kwargs(RowParams.from_json(_row_params(r)), self.cfg.sampling, self._template_thinking)
        text = self.tokenizer.apply_chat_template(r["messages"], tokenize=False, add_generation_prompt=True,
                                                  **variables)
        return text, self.tokenizer(text, add_special_tokens=False)["input_ids"]

    @functools.cached_property
    def _template_thinking(self) -> TemplateThinking:
        """What the tokenizer's chat template (the one rendering the rows) says about thinking, read once."""
        template = self.tokenizer.chat_template if self.tokenizer is not None else None
        return template_thinking(template if isinstance(template, str) else None)

    def _fail(self, rid: str, reason: str, prompt_tokens: int = 0) -> None:
        group = self.groups.pop(rid)
        self.pending.extend(_error_row(r, reason, prompt_tokens=prompt_tokens) for r in group.rows)
        self.progress.tick(len(group.rows), 0)

    def _take(self, res: GenResult, *, last: bool = False) -> None:
        reason = None
        schema = self._schema_of(res.key)
        if schema is not None and not res.error:
            reason = unfinished_thinking(res) or self._schema_problem(res, schema)
        req = self.retryable.pop(res.key, None)
        self.gen_tokens += res.completion_tokens
        if reason and req is not None and not last:
            assert self.retry is not None  # req is retryable: only _generate fills that, while it holds the spool
            self.retry.add(req)  # asked again once the first pass is through; the group stays open
            return
        group = self.groups.pop(res.key)
        entry = {"output": res.text, "finish_reason": res.finish_reason, "prompt_tokens": res.prompt_tokens,
                 "completion_tokens": res.completion_tokens, "cached_prompt_tokens": res.cached_prompt_tokens,
                 **sample_fields(res), **_reasoning_fields(res)}
        if res.embedding is not None:  # a vector, no text: output stays null
            entry.update(output=None, embedding=res.embedding)
        if res.scores is not None:  # class probabilities, no text: output stays null
            entry.update(output=None, label=max(res.scores, key=res.scores.__getitem__), scores=res.scores)
        for r in group.rows:
            if res.error:
                self.pending.append(_error_row(r, res.error, prompt_tokens=res.prompt_tokens))
            elif reason:
                self.pending.append(_invalid_row(r, res, reason))
            else:
                self.pending.append(result_row(r, entry, cached=False, key=group.key.content))
        self.progress.tick(len(group.rows), res.completion_tokens)
        self._commit()

    def _schema_of(self, request_id: str) -> OutputSchema | None:
        """The schema a request's output must match: its row's response_format, else sampling.output_schema."""
        rf = self.row_formats.get(request_id)
        if rf is None:
            return self.schema
        if rf not in self._row_schemas:
            self._row_schemas[rf] = OutputSchema(response_schema(rf))
        return self._row_schemas[rf]

    def _schema_problem(self, res: GenResult, schema: OutputSchema) -> str | None:
        """Why the output does not match the schema, or None; with n > 1 every sample must match (the first
        one that does not is named)."""
        texts = [s.text for s in res.samples] if res.samples and len(res.samples) > 1 else [res.text]
        for i, text in enumerate(texts):
            _, reason = schema.check(text)
            if reason:
                return reason if len(texts) == 1 else f"{reason} (sample {i})"
        return None

    def _retry_requests(self, requests: Iterator[GenRequest], attempt: int) -> Iterator[GenRequest]:
        for req in requests:
            s = resolve(req.params, self.cfg.sampling)
            seed = (s.seed or 0) + 1_000_003 * attempt
            again = dataclasses.replace(req, params=dataclasses.replace(req.params or RowParams(), seed=seed),
                                        guided=True if self.fallback else req.guided)
            if not (self.fallback and s.temperature == 0):  # a greedy row under the schema is final
                self.retryable[req.key] = again
            loaded = self._with_images(again)
            if loaded is None:
                self.retryable.pop(req.key, None)
                continue
            yield loaded

    def _commit(self, force: bool = False) -> None:
        e = self.cfg.engine
        if not self.pending or not (force or len(self.pending) >= e.commit_every_rows or
                                    time.perf_counter() - self.last_commit >= e.commit_every_seconds):
            return
        checkpoint("before_commit", self.shard_dir.url)
        # Sorted by input position: the final merge streams the chunks (heapq.merge) in input order.
        self.pending.sort(key=lambda r: r["idx"])
        write_jsonl(self.chunks_dir.child(f"chunk-{self.chunk_seq:05d}-{uuid.uuid4().hex[:8]}.jsonl").path(),
                    self.pending)
        self.chunk_seq += 1
        self.pending = []
        self.last_commit = time.perf_counter()
        checkpoint("after_commit", self.shard_dir.url)

    def _finish(self, t_start: float) -> ShardManifest:
        self.timeline.begin("merge")
        manifest = finish_shard(self.shard.index, self.shard_dir, self.chunks_dir, self.shard_path, self.n_rows)
        manifest.plan_key = self.shard.plan_key
        self.timeline.end("merge")
        self.timeline.begin("commit")
        if self.cache is not None:  # the rows this shard generated (earlier attempts' too), as one table
            table = self.cache.write_table({k: r[k] for k in ("key", "output", "finish_reason", "prompt_tokens",
                                                              "completion_tokens", *RESULT_FIELDS) if k in r}
                                           for r in iter_jsonl(Location(manifest.outputs, self.shard_dir.options).path())
                                           if not r["cached"] and r.get("key"))
            self.say(f"cache: wrote {table}")
        info = self.info
        paid = info is not None and (self.shared is None or self.shared.paid_by(self.shard.index))
        manifest.metrics = manifest.metrics.model_copy(update=dict(
            engine_start_seconds=round(info.start_seconds, 2) if info and paid else 0.0,
            engine_shared_from=self.shared.started_by if info and self.shared and not paid else None,
            generate_seconds=round(self.gen_seconds, 2), cached_rows=self.n_cached,
            seconds=round(time.perf_counter() - t_start, 2), output_tokens_this_attempt=self.gen_tokens,
            output_tokens_per_second=round(self.gen_tokens / self.gen_seconds, 1) if self.gen_seconds else 0.0,
            unique_prompts=self.n_prompts, peak_rss_mb=peak_rss_mb(), outputs_asked_again=self.n_retried))
        manifest.cache_lookup = self.lookup.stats if self.lookup is not None else None
        manifest.engine = EngineRecord(kind=self.cfg.engine.kind, version=info.version if info else None,
                                       settings=info.settings if info else {},
                                       attempts=info.attempts if info and paid else [])
        self.timeline.end("commit")
        # the manifest write itself is the last few ms of commit
        manifest.phases = [Phase(**p) for p in self.timeline.to_list()]
        checkpoint("before_manifest", self.shard_dir.url)
        manifest.write(self.shard_dir.path())
        m = manifest.metrics
        self.say(f"shard {self.shard.index} done: {m.rows} rows, {m.errors} errors, "
                 f"{m.output_tokens} output tokens, {m.output_tokens_per_second} tok/s")
        check_error_rate(self.cfg, manifest)
        return manifest


def run_shard(cfg: PipelineConfig, *, shard: ShardSpec, shard_dir: Location, model_dir: str, model_key: str,
              cache_root: Location | None = None, say: Callable[[str], None] = print,
              started: dict | None = None, lora_dir: str | None = None,
              on_committed: Callable[[ShardManifest], None] | None = None,
              shared_engine: SharedEngine | None = None, image_options: dict | None = None) -> ShardManifest:
    """Runs one shard to completion (or resumes it) and returns its manifest (see ``ShardRun``); ``lora_dir``:
    a LoRA adapter the engine serves on every request; ``shared_engine``: the engine of the task's shards;
    ``image_options``: the storage options its rows' images are read with (the input's)."""
    return ShardRun(cfg, shard=shard, shard_dir=shard_dir, model_dir=model_dir, model_key=model_key,
                    cache_root=cache_root, say=say, started=started, lora_dir=lora_dir,
                    on_committed=on_committed, shared_engine=shared_engine, image_options=image_options).run()


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
    its hash (``result_cache.namespace``) and a shard's resume key holds it (``stages.shard_inputs``), so a
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


def check_error_rate(cfg: PipelineConfig, manifest: ShardManifest) -> None:
    m = manifest.metrics
    rate = m.failed / m.rows if m.rows else 0.0
    if rate > cfg.engine.max_error_rate:
        raise ShardFailed(f"shard {manifest.shard}: {m.failed} of {m.rows} rows failed "
                          f"({rate:.0%} > engine.max_error_rate {cfg.engine.max_error_rate:.0%}); "
                          f"reasons are in {manifest.errors}")



def shard_inputs(cfg: PipelineConfig, ref: ModelRef, shard: ShardSpec) -> dict[str, str]:
    """What a shard's committed chunks are made from, part by part (short hashes): its plan and everything that
    changes an output (``infer.output_identity``, which the result cache's namespace hashes too)."""
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


def shard_tasks(cfg: PipelineConfig, plan: PlanManifest) -> list[list[ShardSpec]]:
    """The plan's shards as the inference tasks run them: ``sharding.shards_per_task`` consecutive shards a
    task (the last task may have fewer), each task one engine (``infer_shards``)."""
    k = cfg.sharding.shards_per_task
    return [plan.shards[i:i + k] for i in range(0, len(plan.shards), k)]


def infer_shards(cfg: PipelineConfig, layout: RunLayout, model: ModelRef | FetchManifest | QuantizeManifest | dict,
                 shards: list[ShardSpec | dict], say: Callable[[str], None] = print, started: dict | None = None,
                 on_committed: Callable[[list[ShardManifest]], None] | None = None,
                 stage: str = "infer") -> list[ShardManifest]:
    """Runs one task's shards in turn on one engine (``infer.SharedEngine``): the first shard that generates
    starts it, the others use it, and it is closed after the last. Each shard keeps its own folder, chunk
    commits and manifest, so a retry skips the shards already committed and resumes the one that was cut
    short. ``on_committed`` is called with every shard's manifest once the last one is durable (the worker
    reports there and ends the engine's processes itself); ``started`` (the worker's clock) goes to the
    first shard's timeline. One shard: ``infer_shard`` as it is.

    A shard with too many error rows (``ShardFailed``: its outputs, errors and manifest are written) does not stop
    the task's other shards: they run and commit, then the task fails naming the failed shards, as separate
    tasks would have (a re-run with a higher ``engine.max_error_rate`` takes every committed shard as it is)."""

    specs = [ShardSpec.model_validate(s) for s in shards]
    if len(specs) == 1:
        last = (lambda m: on_committed([m])) if on_committed is not None else None
        return [infer_shard(cfg, layout, model, specs[0], say=say, started=started, on_committed=last, stage=stage)]
    engine = SharedEngine()
    done: list[ShardManifest] = []
    failed: list[str] = []
    try:
        for i, spec in enumerate(specs):
            last = None
            if on_committed is not None and i == len(specs) - 1 and not failed:  # reported only if all passed
                last = lambda m: on_committed([*done, m])  # noqa: E731
            try:
                done.append(infer_shard(cfg, layout, model, spec, say=say, started=started if i == 0 else None,
                                        on_committed=last, shared_engine=engine, stage=stage))
            except ShardFailed as e:
                failed.append(str(e))
                say(f"{e}; the task's other shards go on")
    finally:
        engine.close()
    say(f"{len(specs)} shards on one engine: started {engine.starts} time(s)")
    if failed:
        raise ShardFailed(f"{len(failed)} of {len(specs)} shards of this task failed (the others committed): "
                          + " | ".join(failed))
    return done


def infer_shard(cfg: PipelineConfig, layout: RunLayout, model: ModelRef | FetchManifest | QuantizeManifest | dict,
                shard: ShardSpec | dict,
                say: Callable[[str], None] = print, started: dict | None = None,
                on_committed: Callable[[ShardManifest], None] | None = None,
                shared_engine: "SharedEngine | None" = None, stage: str = "infer") -> ShardManifest:
    """Runs one shard in this process (the GPU operator runs it in a spawned worker instead, which passes its
    own start times as ``started`` and reports from ``on_committed``, before the engine's shutdown).
    ``shared_engine``: the ``infer.SharedEngine`` of the task's shards (``infer_shards``). ``stage``: the run's
    folder the shard commits in (``review``: the content review's pass, ``stages.review``)."""

    shard = ShardSpec.model_validate(shard)
    ref = ModelRef.of(model)
    shard_dir = layout.shard_dir(shard.index, stage)
    drop_stale_shard(shard_dir, shard_inputs(cfg, ref, shard), say)
    return run_shard(cfg, shard=shard, shard_dir=shard_dir,
                     model_dir=ref.local_dir, model_key=ref.model_key, lora_dir=ref.lora_dir,
                     cache_root=layout.cache_root(cfg), say=say, started=started, on_committed=on_committed,
                     shared_engine=shared_engine, image_options=layout.input.options)
