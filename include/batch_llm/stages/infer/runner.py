"""One shard's run: resumable, exactly once, per-row errors, progress, metrics, a timeline.

How a shard is run (``ShardRun``, one method per step; a row becomes a request in ``request_builder``, a result
becomes rows in ``results``, what changes an output is ``identity``)::

    read      rows (streamed) ─> request key = chat or token ids (+ row max_tokens); the chat template and
              the sampling are in the cache namespace; identical prompts fold into one request
              └> cache lookup (streamed) ─> hits become committed results without the engine or a tokenizer
    engine    if anything is left: the engine starts (in a thread of its own with OVERLAP_ENGINE_START, off:
              see there), and meanwhile
    tokenize  rows (streamed again) ─> chat template + tokenizer ─> a local spool of requests; rows that cannot
              become one (the template rejects the chat, the prompt is longer than the context) are error rows
    generate  spooled requests, then the rest of the rows ─> engine (streamed) ─> chunks committed as results
              finish
    commit    finished rows ─> immutable chunks as they come (``commit.ShardCommit``); at the end the chunks
              ─> outputs.jsonl / errors.jsonl (``shard_merge``) ─> cache table ─> manifest

A task of several shards (``sharding.shards_per_task``) runs them in turn on one engine (``SharedEngine``):
the first that generates starts it, the others find it started. Committed chunks are immutable files under
``<shard>/chunks/``; a retry reads them, skips every committed
row id and generates only the rest. ``manifest.json`` is written last. Each phase's wall-clock interval goes
into the manifest (``phases``, see ``timeline.py``): the report draws them, the doctor names the largest.
"""
from __future__ import annotations

import logging
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from batch_llm.analysis.timeline import Timeline
from batch_llm.cache.lengths import HISTORY_LEVELS, LengthRecorder
from batch_llm.cache.lengths import store_for as lengths_store
from batch_llm.cache.lookup import Lookup
from batch_llm.cache.results import ResultCache, namespace, prompt_key
from batch_llm.config import PipelineConfig
from batch_llm.engines.base import Engine, EngineInfo, GenRequest, GenResult
from batch_llm.engines.precision_gate import PrecisionInputs, sample_params
from batch_llm.engines.start import start_engine
from batch_llm.io.storage import Location, iter_jsonl, peak_rss_mb
from batch_llm.manifests import EngineRecord, Phase, ShardManifest, ShardSpec
from batch_llm.rows.prefix import prefix_groups, prompt_bytes
from batch_llm.stages.infer.commit import ShardCommit
from batch_llm.stages.infer.identity import output_identity, with_reasoning_parser
from batch_llm.stages.infer.request_builder import RequestBuilder, RequestSpool, prompt_basis, row_params
from batch_llm.stages.infer.results import OutputChecks, cache_entries, error_row, result_row, result_rows

log = logging.getLogger("batch_llm.stages.infer")


class ShardFailed(RuntimeError):
    """The shard finished but too many rows failed; its outputs and errors were still written."""


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
    prefix: tuple[int, int] = (0, 0)  # its prompt's groups in the length history (cache/lengths.py), where recorded


# as before; overlapping it needs the imports done in the main thread beforehand (not yet tested). It would
# save little: after vLLM's import the tokenizer loads in ~0.4 s and renders ~0.15 ms a chat row (2-core CPU).
OVERLAP_ENGINE_START = False


class _EngineStarter(threading.Thread):
    """Starts the engine (imports, memory back-off, probe) while the caller tokenizes: engine start is mostly
    waiting on the engine's own processes, so the two overlap instead of adding up."""

    def __init__(self, model_dir: str, cfg: PipelineConfig, say: Callable[[str], None], timeline: Timeline,
                 lora_dir: str | None = None, storage_options: dict | None = None,
                 precision: PrecisionInputs | None = None):
        super().__init__(name="engine-start", daemon=True)
        self.model_dir, self.cfg, self.say, self.timeline = model_dir, cfg, say, timeline
        self.lora_dir, self.precision = lora_dir, precision
        self.storage_options = storage_options  # engine.compile_cache's store: the output's
        self.engine: Engine | None = None
        self.info: EngineInfo | None = None
        self.error: BaseException | None = None

    @classmethod
    def of(cls, run: ShardRun) -> _EngineStarter:
        """The start of a shard's engine (the shard's model, LoRA adapter, timeline; its output's storage)."""
        return cls(run.model_dir, run.cfg, run.say, run.timeline, lora_dir=run.lora_dir,
                   storage_options=run.shard_dir.options,
                   precision=PrecisionInputs(sample=run.precision_sample, model_key=run.model_key,
                                             store=run.cache_root.child("precision") if run.cache_root else None))

    def run(self) -> None:
        t0 = time.time()
        try:
            self.engine, self.info = start_engine(self.model_dir, with_reasoning_parser(self.cfg, self.model_dir),
                                                  self.say, lora_dir=self.lora_dir,
                                                  storage_options=self.storage_options, precision=self.precision)
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
    shard that paid), closed by the caller once the last shard is done (``tasks.infer_shards``). A shard that
    is already committed, or served whole from the result cache, starts nothing: the next one that generates
    pays the start."""

    def __init__(self) -> None:
        self.engine: Engine | None = None
        self.info: EngineInfo | None = None
        self.started_by: int | None = None   # the shard whose start it was
        self.starts = 0

    def get(self, run: "ShardRun") -> tuple[Engine, EngineInfo]:
        if self.engine is None:
            starter = _EngineStarter.of(run)
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
def _timeline(started: dict) -> Timeline:
    """A shard's timeline, from the worker's own clock where it has one (``started``: epoch seconds)."""
    timeline, now = Timeline(), time.time()
    if started.get("spawned_at") and started.get("worker_started_at"):
        timeline.add("spawn", started["spawned_at"], started["worker_started_at"])
    if started.get("worker_started_at"):
        timeline.add("imports", started["worker_started_at"], now)
    return timeline


def _open_cache(cfg: PipelineConfig, root: Location | None, model_key: str, model_dir: str) -> ResultCache | None:
    if root is None or not cfg.cache.enabled:
        return None
    ns = namespace(output_identity(cfg, model_key=model_key, model_dir=model_dir))
    return ResultCache(root, ns, max_age_days=cfg.cache.max_age_days)


class ShardRun:
    """One shard, run to completion or resumed; ``run()`` returns its manifest.

    ``shard`` is the planner's entry (``ShardSpec``: index, rows, the shard file's url). ``started`` carries the
    worker's own clock (``spawned_at``, ``worker_started_at``, epoch seconds) for the timeline. ``on_committed``
    is called with the manifest once it is durable and the shard passed its error-rate check, before the engine
    is shut down: the worker reports there and ends its engine's processes itself (``batch_llm.isolation.worker_parent``).
    ``shared_engine``: the engine of the task's shards (``SharedEngine``), which the shard neither starts when
    another did nor closes. Rows become requests in ``requests`` (``request_builder.RequestBuilder``); outputs are
    checked against their schema, and asked again, in ``checks`` (``results.OutputChecks``); finished rows are
    written in chunks, merged and recorded in the manifest by ``commit`` (``commit.ShardCommit``)."""

    def __init__(self, cfg: PipelineConfig, *, shard: ShardSpec, shard_dir: Location, model_dir: str, model_key: str,
                 cache_root: Location | None = None, say: Callable[[str], None] = print,
                 started: dict | None = None, lora_dir: str | None = None,
                 on_committed: Callable[[ShardManifest], None] | None = None,
                 shared_engine: SharedEngine | None = None, image_options: dict | None = None):
        self.cfg, self.shard, self.shard_dir, self.say = cfg, shard, shard_dir, say
        self.on_committed = on_committed
        self.shared = shared_engine
        self.engine: Engine | None = None
        self.model_dir, self.model_key, self.lora_dir = model_dir, model_key, lora_dir
        self.shard_path = Location(shard.url, shard_dir.options).path()
        self.commit = ShardCommit(cfg.engine, shard_dir)
        self.timeline = _timeline(started or {})
        self.dedupe = cfg.engine.dedupe_prompts and (cfg.sampling.temperature == 0 or cfg.sampling.seed is not None)
        self.cache_root = cache_root
        self.cache = _open_cache(cfg, cache_root, model_key, model_dir)
        # what this attempt generates, per prompt prefix group: the next plans' order (sharding.length_history)
        self.lengths = LengthRecorder() if cache_root is not None and cfg.sharding.uses_length_history else None
        self.groups: dict[str, _Group] = {}    # request_id -> the rows its result answers
        self.sent_by: dict[str, str] = {}       # row id -> request_id, for the row whose prompt is sent
        self.n_rows = self.n_cached = self.gen_tokens = 0
        self.gen_seconds = 0.0
        self.lookup: Lookup | None = None
        self.info: EngineInfo | None = None
        # image_options: the input's storage options: its rows' images are read with them
        self.requests = RequestBuilder(cfg, model_dir=model_dir, image_options=image_options or {},
                                       groups=self.groups, sent_by=self.sent_by, fail=self._fail,
                                       timeline=self.timeline)
        self.checks = OutputChecks(cfg)

    # ---------------------------------------------------------------------------------- the steps
    def run(self) -> ShardManifest:
        t_start = time.perf_counter()
        if manifest := ShardManifest.read_if_done(self.shard_dir.path()):
            self.say(f"shard {self.shard.index} already committed: {manifest.metrics.rows} rows; nothing to do")
            check_error_rate(self.cfg, manifest)
            return self._committed(manifest)
        self.timeline.begin("read")
        done = self.commit.committed_ids()
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
            self.commit.write_chunk(force=True)
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
            key = RequestKey(prompt_key(prompt_basis(r), row_params(r)), None if self.dedupe else r["id"])
            group = self.groups.get(key.request_id)
            if group is None:
                group = self.groups[key.request_id] = _Group(key)
                self.sent_by[r["id"]] = key.request_id
                if self.lengths is not None:
                    data = prompt_bytes(r.get("text"), r.get("messages"), r.get("prompt_token_ids"),
                                        HISTORY_LEVELS[-1])
                    g64, g512 = prefix_groups(data, HISTORY_LEVELS)
                    group.prefix = (g64, g512)
            group.rows.append((r["id"], r["idx"]))
            self.checks.note_format(key.request_id, row_params(r))
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
                    self.commit.add([result_row(r, hit, cached=True, key=hit["key"])])
                    self.n_cached += 1
                    self.progress.tick(1, 0)
            self.commit.write_chunk()
        self.say(f"cache: {self.n_cached} rows cached; lookup {lookup.stats}")
        self.commit.write_chunk()

    def _generate(self) -> None:
        checks, starter = self.checks, None
        if self.shared is None:
            starter = _EngineStarter.of(self)
            if OVERLAP_ENGINE_START and self.cfg.engine.caps.overlap_engine_start:  # LMDeploy binds its thread's loop
                starter.start()
            else:
                starter.run()
        rows = iter_jsonl(self.shard_path)
        with tempfile.TemporaryDirectory(prefix="batch_llm_requests_") as tmp:
            checks.retry = RequestSpool(Path(tmp) / "retry-0.jsonl")
            spooled = None
            if starter is not None:
                spooled = self.requests.tokenize_while(starter.is_alive, rows, Path(tmp) / "requests.jsonl")
                engine, self.info = starter.result()
                self.engine = engine  # closed by run(), once the manifest is written
                self.say(f"engine {self.info.kind} {self.info.version} started in {self.info.start_seconds:.1f}s: "
                         f"{self.info.settings}")
            else:
                assert self.shared is not None
                engine, self.info = self.shared.get(self)  # closed by its owner, after the task's last shard
            self.requests.info = self.info  # the context it started with
            t_gen, t0 = time.perf_counter(), time.time()
            self.progress.t0 = self.progress.last = t_gen  # rates and ETA count generation, not engine start
            first = None
            try:
                for res in engine.generate(self.requests.requests(spooled, rows, checks.sent)):
                    if first is None:
                        first = time.time()
                        self.timeline.add("first_token", t0, first)
                    self._take(res)
                for res, last in checks.ask_again(engine, Path(tmp), self.requests.with_images, self.say):
                    self._take(res, last=last)
            finally:
                self.gen_seconds = time.perf_counter() - t_gen
                self.timeline.add("generation", first or t0)

    def precision_sample(self) -> list[GenRequest]:
        """engine.precision: auto's calibration sample: the shard's first text rows that render and fit the
        context, as greedy requests (``precision_gate.sample_params``); built only when a calibration runs."""
        gate, limit = self.cfg.engine.precision_gate, self.cfg.engine.max_model_len
        params = sample_params(gate.max_tokens)
        sample: list[GenRequest] = []
        for r in iter_jsonl(self.shard_path):
            if len(sample) >= gate.sample_rows:
                break
            if r.get("images"):
                continue
            try:
                text, ids = self.requests.render(r)
            except Exception:  # noqa: BLE001 - a row the shard will report itself; the sample takes the next
                continue
            if limit and len(ids) + gate.max_tokens > limit:
                continue
            sample.append(GenRequest(key=f"precision-sample-{len(sample)}", prompt_token_ids=ids, prompt_text=text,
                                     params=params, guided=False))
        return sample

    def _fail(self, rid: str, reason: str, prompt_tokens: int = 0) -> None:
        group = self.groups.pop(rid)
        self.commit.add(error_row(r, reason, prompt_tokens=prompt_tokens) for r in group.rows)
        self.progress.tick(len(group.rows), 0)

    def _take(self, res: GenResult, *, last: bool = False) -> None:
        asked_again, reason = self.checks.verdict(res, last=last)
        self.gen_tokens += res.completion_tokens
        if asked_again:
            return
        group = self.groups.pop(res.key)
        if self.lengths is not None and not res.error:
            self.lengths.add(group.prefix, res.completion_tokens)
        self.commit.add(result_rows(res, group.rows, group.key.content, reason))
        self.progress.tick(len(group.rows), res.completion_tokens)
        self.commit.write_chunk()

    def _finish(self, t_start: float) -> ShardManifest:
        self.timeline.begin("merge")
        manifest = self.commit.merge(self.shard, self.shard_path, self.n_rows)
        self.timeline.end("merge")
        self.timeline.begin("commit")
        if self.cache is not None:  # the rows this shard generated (earlier attempts' too), as one table
            table = self.cache.write_table(
                cache_entries(iter_jsonl(Location(manifest.outputs, self.shard_dir.options).path())))
            self.say(f"cache: wrote {table}")
        if self.lengths is not None:
            self._write_lengths()
        _record(self, manifest, t_start)
        self.timeline.end("commit")
        # the manifest write itself is the last few ms of commit
        manifest.phases = [Phase(**p) for p in self.timeline.to_list()]
        self.commit.write_manifest(manifest)
        m = manifest.metrics
        self.say(f"shard {self.shard.index} done: {m.rows} rows, {m.errors} errors, "
                 f"{m.output_tokens} output tokens, {m.output_tokens_per_second} tok/s")
        check_error_rate(self.cfg, manifest)
        return manifest


    def _write_lengths(self) -> None:
        """This attempt's generated lengths, for the next plans' order: a hint, so a failed write is said, not
        raised (the shard's outputs are committed either way)."""
        assert self.lengths is not None and self.cache_root is not None
        store = lengths_store(self.cache_root, self.cfg)
        try:
            if name := self.lengths.write(store):
                self.say(f"length history: {len(self.lengths.groups)} prompt groups recorded in {store.url}/{name}")
        except Exception as e:  # noqa: BLE001 - a hint: whatever the store raised, the shard goes on
            self.say(f"length history: not recorded in {store.url} ({e!r})")


def _record(run: ShardRun, manifest: ShardManifest, t_start: float) -> None:
    """What this attempt at the shard did, on its manifest: its metrics, the cache lookup's, the engine; an engine's
    start counts for the shard that paid it (``SharedEngine``)."""
    info = run.info
    paid = info is not None and (run.shared is None or run.shared.paid_by(run.shard.index))
    manifest.metrics = manifest.metrics.model_copy(update=dict(
        engine_start_seconds=round(info.start_seconds, 2) if info and paid else 0.0,
        engine_shared_from=run.shared.started_by if info and run.shared and not paid else None,
        generate_seconds=round(run.gen_seconds, 2), cached_rows=run.n_cached,
        seconds=round(time.perf_counter() - t_start, 2), output_tokens_this_attempt=run.gen_tokens,
        output_tokens_per_second=round(run.gen_tokens / run.gen_seconds, 1) if run.gen_seconds else 0.0,
        unique_prompts=run.n_prompts, peak_rss_mb=peak_rss_mb(), outputs_asked_again=run.checks.n_retried))
    manifest.cache_lookup = run.lookup.stats if run.lookup is not None else None
    manifest.engine = EngineRecord(kind=run.cfg.engine.kind, version=info.version if info else None,
                                   settings=info.settings if info else {},
                                   attempts=info.attempts if info and paid else [])


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


def check_error_rate(cfg: PipelineConfig, manifest: ShardManifest) -> None:
    m = manifest.metrics
    rate = m.failed / m.rows if m.rows else 0.0
    if rate > cfg.engine.max_error_rate:
        raise ShardFailed(f"shard {manifest.shard}: {m.failed} of {m.rows} rows failed "
                          f"({rate:.0%} > engine.max_error_rate {cfg.engine.max_error_rate:.0%}); "
                          f"reasons are in {manifest.errors}")

