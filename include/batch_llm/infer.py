"""Batch inference over one shard: resumable, exactly once, per-row errors, progress, metrics.

How a shard is run::

    rows (streamed) ─> key = chat or token ids (+ row max_tokens); template and sampling in the namespace
                        └> cache lookup ─> hits become results without the engine (or a tokenizer)
                        └> identical prompts folded into one request
    rows (streamed again) ─> render + tokenize ─> error rows (template rejects the chat, prompt too long)
                          └> engine (streamed requests) ─> chunks committed as results finish

Committed chunks are immutable files under ``<shard>/chunks/``; a retry reads them, skips every committed
row id and generates only the rest. Each chunk is sorted by input position, so the final ``outputs.jsonl``
is a streamed merge of the chunks (one row per id, in input order); ``manifest.json`` is written last.
"""
from __future__ import annotations

import hashlib
import heapq
import json
import logging
import os
import signal
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from batch_llm.config import EngineConfig, PipelineConfig
from batch_llm.engines.base import EngineInfo, EngineStartError, GenRequest, make_engine
from batch_llm.result_cache import ResultCache, namespace, prompt_key
from batch_llm.storage import Location, atomic_writer, exists, iter_jsonl, list_files, read_manifest, \
    write_jsonl, write_manifest

log = logging.getLogger("batch_llm.infer")


class ShardFailed(RuntimeError):
    """The shard finished but too many rows failed; its outputs and errors were still written."""


def maybe_crash(point: str) -> None:
    """Fault injection for the resume tests: BATCH_LLM_FAULT="after_commit:2" kills this process with
    SIGKILL the 2nd time the named point is reached. Unset in production: costs one dict lookup."""
    spec = os.environ.get("BATCH_LLM_FAULT")
    if not spec:
        return
    name, _, nth = spec.partition(":")
    if name != point:
        return
    count = _fault_counts.get(point, 0) + 1
    _fault_counts[point] = count
    if count == int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)


_fault_counts: dict[str, int] = {}


# ------------------------------------------------------------------------------------------ engine start
def start_engine(model_dir: str, cfg: PipelineConfig, say: Callable[[str], None]):
    """Starts the engine, retrying a start that failed for memory with smaller settings within bounds; with
    ``engine.memory_backoff.probe``, restarts it once with the largest batch its KV cache holds, less the
    safety margin."""
    engine, info = _start_with_backoff(model_dir, cfg.engine, cfg, say)
    b = cfg.engine.memory_backoff
    if not b.probe:
        return engine, info
    s = info.settings
    probe = kv_cache_probe(s, b)
    if probe is None:
        say("probe: the engine did not report its KV cache size; max_num_seqs kept")
        return engine, info
    chosen = probe["max_num_seqs"]
    say(f"probe: the KV cache holds {probe['kv_cache_tokens']:,} tokens = {probe['sequences_that_fit']:,} "
        f"sequences of {s['max_model_len']:,} tokens; max_num_seqs {chosen} keeps {b.safety_margin:.0%} free "
        f"(was {s.get('max_num_seqs')})")
    if chosen == s.get("max_num_seqs"):
        info.settings["probe"] = probe
        return engine, info
    engine.close()
    ecfg = info.config.model_copy(update={"max_num_seqs": chosen})
    engine, again = _start_with_backoff(model_dir, ecfg, cfg, say)
    again.start_seconds += info.start_seconds  # the probe's start is part of this shard's start cost
    again.attempts = info.attempts + again.attempts
    again.settings["probe"] = probe
    return engine, again


def kv_cache_probe(settings: dict, b) -> dict | None:
    """The most sequences of max_model_len tokens the KV cache holds, and max_num_seqs: that less the safety
    margin, within bounds. None when the engine did not report its KV cache."""
    blocks, block, max_len = settings.get("num_kv_blocks"), settings.get("block_size"), settings.get("max_model_len")
    if not (blocks and block and max_len):
        return None
    fits = blocks * block // max_len
    return {"kv_cache_tokens": blocks * block, "max_model_len": max_len, "sequences_that_fit": fits,
            "safety_margin": b.safety_margin,
            "max_num_seqs": max(1, min(b.probe_max_num_seqs, int(fits * (1 - b.safety_margin))))}


def _start_with_backoff(model_dir: str, ecfg: EngineConfig, cfg: PipelineConfig, say: Callable[[str], None]):
    b = ecfg.memory_backoff
    attempts: list[dict] = []
    for attempt in range(1, b.max_attempts + 1):
        engine = make_engine(model_dir, ecfg, cfg.sampling, trust_remote_code=cfg.model.trust_remote_code)
        tried = dict(gpu_memory_utilization=ecfg.gpu_memory_utilization, max_num_seqs=ecfg.max_num_seqs,
                     max_model_len=ecfg.max_model_len)
        try:
            info = engine.start()
        except EngineStartError as e:
            engine.close()
            attempts.append({**tried, "error": str(e)[-500:], "memory": e.memory})
            if not (e.memory and b.enabled and attempt < b.max_attempts):
                raise
            smaller = _smaller_settings(ecfg, e)
            if smaller is None:
                raise EngineStartError(f"{e}\nno smaller setting is left within engine.memory_backoff bounds",
                                       memory=True) from e
            say(f"engine start failed for memory (attempt {attempt}); retrying with {smaller}")
            ecfg = ecfg.model_copy(update=smaller)
            continue
        attempts.append({**tried, "ok": True})
        info.attempts = attempts
        info.config = ecfg
        if attempt > 1:
            say(f"engine started after back-off with {tried}")
        return engine, info
    raise AssertionError("unreachable")


def _smaller_settings(e: EngineConfig, err: EngineStartError) -> dict | None:
    b = e.memory_backoff
    upd: dict = {}
    if err.suggested_max_model_len and e.max_model_len and err.suggested_max_model_len < e.max_model_len:
        upd["max_model_len"] = max(b.min_max_model_len, err.suggested_max_model_len // 16 * 16)
    else:
        util = round(e.gpu_memory_utilization - b.gpu_memory_utilization_step, 3)
        if util >= b.min_gpu_memory_utilization:
            upd["gpu_memory_utilization"] = util
        seqs = (e.max_num_seqs or 256) // 2
        if seqs >= b.min_max_num_seqs:
            upd["max_num_seqs"] = seqs
        if e.max_model_len and e.max_model_len // 2 >= b.min_max_model_len and not upd:
            upd["max_model_len"] = e.max_model_len // 2
    upd = {k: v for k, v in upd.items() if getattr(e, k) != v}
    return upd or None


# ------------------------------------------------------------------------------------------ the shard
@dataclass
class _Progress:
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
    if override:
        return override
    from pathlib import Path

    jinja = Path(model_dir) / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text(encoding="utf-8")
    try:
        value = json.loads((Path(model_dir) / "tokenizer_config.json").read_text(encoding="utf-8")).get("chat_template")
    except (OSError, ValueError):
        return ""
    return value if isinstance(value, str) else json.dumps(value or "")


def _load_tokenizer(model_dir: str, chat_template: str | None, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    if chat_template:
        tok.chat_template = chat_template
    if not tok.chat_template:
        raise ValueError(f"the model at {model_dir} has no chat template; set model.chat_template")
    return tok


def _committed_ids(chunks_dir: Location) -> set[str]:
    return {r["id"] for f in list_files(chunks_dir.path(), ".jsonl") for r in iter_jsonl(f)}


def _peak_rss_mb() -> float:
    import resource

    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def run_shard(cfg: PipelineConfig, *, shard: dict, shard_dir: Location, model_dir: str, model_key: str,
              cache_root: Location | None = None, say: Callable[[str], None] = print) -> dict:
    """Runs one shard to completion (or resumes it) and returns its manifest.

    ``shard`` is the planner's entry: ``{"index", "rows": N, "url": <rows.jsonl>}``.
    """
    t_start = time.perf_counter()
    mpath = shard_dir.path() / "manifest.json"
    if exists(mpath):
        manifest = read_manifest(mpath)
        say(f"shard {shard['index']} already committed: {manifest['metrics']['rows']} rows; nothing to do")
        _check_error_rate(cfg, manifest)
        return manifest

    # The shard file is streamed twice (plan the requests, then feed them), so memory holds a few small
    # fields per row rather than every prompt: a 100k-row shard costs what a 10k-row one does.
    shard_path = Location(shard["url"], shard_dir.options).path()
    chunks_dir = shard_dir.child("chunks")
    done = _committed_ids(chunks_dir)
    if done:
        say(f"resuming shard {shard['index']}: {len(done)} rows already committed")

    tok = None

    def render(r: dict) -> tuple[str, list[int]]:
        nonlocal tok
        if "prompt_token_ids" in r:  # pre-tokenized rows need no tokenizer
            return "", r["prompt_token_ids"]
        if tok is None:
            tok = _load_tokenizer(model_dir, cfg.model.chat_template, cfg.model.trust_remote_code)
        text = tok.apply_chat_template(r["messages"], tokenize=False, add_generation_prompt=True)
        return text, tok(text, add_special_tokens=False)["input_ids"]

    dedupe = cfg.engine.dedupe_prompts and (cfg.sampling.temperature == 0 or cfg.sampling.seed is not None)
    max_len = cfg.engine.max_model_len
    # Keys come from the chat (or token ids) plus the chat template in the namespace: the same thing as the
    # rendered prompt, known without loading a tokenizer, so a fully cached shard costs almost nothing.
    groups: dict[str, list[tuple[str, int]]] = {}  # request key -> rows (id, idx) that share its result
    first_row: dict[str, str] = {}       # row id -> request key, for the row whose prompt is sent
    n_rows = 0
    for r in iter_jsonl(shard_path):
        n_rows += 1
        if r["id"] in done:
            continue
        basis = ["ids", r["prompt_token_ids"]] if "prompt_token_ids" in r else ["chat", r["messages"]]
        key = prompt_key(basis, r.get("max_tokens"))
        rk = key if dedupe else f"{key}#{r['id']}"
        if rk not in groups:
            groups[rk] = []
            first_row[r["id"]] = rk
        groups[rk].append((r["id"], r["idx"]))
    n_prompts = len({rk.split("#")[0] for rk in groups})

    sampling = cfg.sampling.model_dump()
    ns = namespace(model_key=model_key, chat_template=chat_template_text(model_dir, cfg.model.chat_template),
                   sampling=sampling,
                   engine_kind=cfg.engine.kind)
    cache = ResultCache(cache_root, ns, max_age_days=cfg.cache.max_age_days) \
        if (cache_root is not None and cfg.cache.enabled) else None
    rks_of: dict[str, list[str]] = {}  # without dedupe a key's rows are requests "<key>#<id>" of their own
    for rk in (groups if cache is not None and not dedupe else ()):
        rks_of.setdefault(rk.split("#")[0], []).append(rk)
    hits = cache.lookup(rks_of or groups) if cache else ()  # streamed: each key found, once

    progress = _Progress(total=n_rows, say=say, every=cfg.engine.progress_every_seconds)
    progress.done = len(done)
    pending: list[dict] = []
    chunk_seq = len(list_files(chunks_dir.path(), ".jsonl"))
    last_commit = time.perf_counter()
    n_cached = 0

    def commit(force: bool = False) -> None:
        nonlocal chunk_seq, last_commit, pending
        if not pending or not (force or len(pending) >= cfg.engine.commit_every_rows or
                               time.perf_counter() - last_commit >= cfg.engine.commit_every_seconds):
            return
        maybe_crash("before_commit")
        # Sorted by input position: the final merge streams the chunks (heapq.merge) in input order.
        pending.sort(key=lambda r: r["idx"])
        write_jsonl(chunks_dir.child(f"chunk-{chunk_seq:05d}-{uuid.uuid4().hex[:8]}.jsonl").path(), pending)
        chunk_seq += 1
        pending = []
        last_commit = time.perf_counter()
        maybe_crash("after_commit")

    # Cache hits first: they cost nothing.
    for hit in hits:
        for rk in rks_of.get(hit["key"]) or [hit["key"]]:
            for r in groups.pop(rk):
                pending.append(_result_row(r, hit, cached=True, key=hit["key"]))
                n_cached += 1
                progress.tick(1, 0)
        commit()
    if cache is not None:
        say(f"cache: {n_cached} rows cached; lookup {hits.stats}")
    commit()

    def fail_group(rk: str, reason: str, prompt_tokens: int = 0) -> None:
        group = groups.pop(rk)
        pending.extend(_error_row(r, reason, prompt_tokens=prompt_tokens) for r in group)
        progress.tick(len(group), 0)

    def requests() -> Iterator[GenRequest]:
        """Second pass over the shard: one request per prompt still to generate, in the planner's order.
        Rows that cannot become a request (the template rejects the chat, the prompt is longer than the
        context) become error rows here."""
        for r in iter_jsonl(shard_path):
            rk = first_row.get(r["id"])
            if rk is None or rk not in groups:
                continue
            try:
                text, ids = render(r)
            except Exception as e:  # noqa: BLE001 - a template that rejects the chat is a row error
                fail_group(rk, f"chat template failed: {e}")
                continue
            if max_len and len(ids) >= max_len:
                fail_group(rk, f"prompt is {len(ids)} tokens; the context (max_model_len) is {max_len}", len(ids))
                continue
            yield GenRequest(key=rk, prompt_token_ids=ids, prompt_text=text, max_tokens=r.get("max_tokens"))

    info: EngineInfo | None = None
    gen_seconds = 0.0
    gen_tokens = 0  # generated in this attempt (a resumed shard's earlier chunks are not counted)
    if groups:
        engine, info = start_engine(model_dir, cfg, say)
        say(f"engine {info.kind} {info.version} started in {info.start_seconds:.1f}s: {info.settings}")
        t_gen = time.perf_counter()
        progress.t0 = progress.last = t_gen  # rates and ETA count generation, not engine start
        try:
            for res in engine.generate(requests()):
                group = groups.pop(res.key)
                entry = {"output": res.text, "finish_reason": res.finish_reason,
                         "prompt_tokens": res.prompt_tokens, "completion_tokens": res.completion_tokens}
                for r in group:
                    if res.error:
                        pending.append(_error_row(r, res.error, prompt_tokens=res.prompt_tokens))
                    else:
                        pending.append(_result_row(r, entry, cached=False, key=res.key.split("#")[0]))
                gen_tokens += res.completion_tokens
                progress.tick(len(group), res.completion_tokens)
                commit()
        finally:
            gen_seconds = time.perf_counter() - t_gen
            engine.close()
    commit(force=True)
    progress.tick(0, 0, force=True)

    manifest = _finish_shard(shard, shard_dir, chunks_dir, shard_path, n_rows)
    if cache is not None:  # the rows this shard generated (earlier attempts' too), as one table
        table = cache.write_table({k: r[k] for k in ("key", "output", "finish_reason", "prompt_tokens",
                                                     "completion_tokens")}
                                  for r in iter_jsonl(Location(manifest["outputs"], shard_dir.options).path())
                                  if not r["cached"] and r.get("key"))
        say(f"cache: wrote {table}")
    m = manifest["metrics"]
    m.update(engine_start_seconds=round(info.start_seconds, 2) if info else 0.0,
             generate_seconds=round(gen_seconds, 2), cached_rows=n_cached,
             seconds=round(time.perf_counter() - t_start, 2),
             output_tokens_this_attempt=gen_tokens,
             output_tokens_per_second=round(gen_tokens / gen_seconds, 1) if gen_seconds else 0.0,
             unique_prompts=n_prompts, peak_rss_mb=_peak_rss_mb())
    manifest["cache_lookup"] = hits.stats if cache is not None else None  # objects and bytes this shard read
    manifest["engine"] = {"kind": cfg.engine.kind, "version": info.version if info else None,
                          "settings": info.settings if info else {}, "attempts": info.attempts if info else []}
    maybe_crash("before_manifest")
    write_manifest(shard_dir.path(), manifest)
    say(f"shard {shard['index']} done: {m['rows']} rows, {m['errors']} errors, {m['output_tokens']} output tokens, "
        f"{m['output_tokens_per_second']} tok/s")
    _check_error_rate(cfg, manifest)
    return manifest


def _result_row(r: tuple[str, int], entry: dict, *, cached: bool, key: str) -> dict:
    return {"id": r[0], "idx": r[1], "output": entry["output"], "finish_reason": entry["finish_reason"],
            "prompt_tokens": entry["prompt_tokens"], "completion_tokens": entry["completion_tokens"],
            "cached": cached, "error": None, "key": key}


def _error_row(r: tuple[str, int], reason: str, prompt_tokens: int = 0) -> dict:
    return {"id": r[0], "idx": r[1], "output": None, "finish_reason": None, "prompt_tokens": prompt_tokens,
            "completion_tokens": 0, "cached": False, "error": reason}


# Chunks merged at once; more are merged in passes through local runs, so open files stay bounded.
MERGE_FAN_IN = 64


def _merged_rows(files: list, tmp_dir: str) -> Iterator[dict]:
    """Rows of idx-sorted JSONL files in one idx-sorted stream, each id once (a row committed twice by an
    interrupted commit is the same row). Holds one row per open file, not the shard."""
    level = 0
    while len(files) > MERGE_FAN_IN:
        runs = []
        for i in range(0, len(files), MERGE_FAN_IN):
            run = Location(os.path.join(tmp_dir, f"run-{level}-{i:06d}.jsonl")).path()
            write_jsonl(run, heapq.merge(*(iter_jsonl(f) for f in files[i:i + MERGE_FAN_IN]),
                                         key=lambda r: r["idx"]))
            runs.append(run)
        files, level = runs, level + 1
    last = None
    for r in heapq.merge(*(iter_jsonl(f) for f in files), key=lambda r: r["idx"]):
        if r["id"] != last:
            yield r
        last = r["id"]


def _finish_shard(shard: dict, shard_dir: Location, chunks_dir: Location, shard_path, n_rows: int) -> dict:
    """Merges committed chunks into outputs.jsonl / errors.jsonl: one row per id, in input order, streamed
    (a worker's memory does not grow with the shard)."""
    chunk_files = list_files(chunks_dir.path(), ".jsonl")
    m = {"rows": n_rows, "ok": 0, "errors": 0, "input_tokens": 0, "output_tokens": 0, "chunks": len(chunk_files)}
    digest = hashlib.sha256(b"[")  # sha256 of the JSON list of ids in input order, built as rows pass
    with tempfile.TemporaryDirectory(prefix="batch_llm_merge_") as tmp, \
            atomic_writer(shard_dir.child("outputs.jsonl").path()) as ok, \
            atomic_writer(shard_dir.child("errors.jsonl").path()) as bad:
        for r in _merged_rows(chunk_files, tmp):
            digest.update(((", " if m["ok"] + m["errors"] else "") + json.dumps(r["id"])).encode())
            m["input_tokens"] += r["prompt_tokens"]
            line = (json.dumps(r, ensure_ascii=False, default=str) + "\n").encode("utf-8")
            if r["error"]:
                m["errors"] += 1
                bad.write(line)
            else:
                m["ok"] += 1
                m["output_tokens"] += r["completion_tokens"]
                ok.write(line)
        if m["ok"] + m["errors"] != n_rows:
            committed = _committed_ids(chunks_dir)
            missing = [r["id"] for r in iter_jsonl(shard_path) if r["id"] not in committed]
            raise RuntimeError(f"shard {shard['index']}: {len(missing)} rows have no committed result "
                               f"(first: {missing[:3]}); the engine dropped requests")
    digest.update(b"]")
    return {
        "stage": "infer", "shard": shard["index"], "status": "ok",
        "outputs": shard_dir.child("outputs.jsonl").url, "errors": shard_dir.child("errors.jsonl").url,
        "metrics": m, "checksum": digest.hexdigest()[:16],
    }


def _check_error_rate(cfg: PipelineConfig, manifest: dict) -> None:
    m = manifest["metrics"]
    rate = m["errors"] / m["rows"] if m["rows"] else 0.0
    if rate > cfg.engine.max_error_rate:
        raise ShardFailed(f"shard {manifest['shard']}: {m['errors']} of {m['rows']} rows failed "
                          f"({rate:.0%} > engine.max_error_rate {cfg.engine.max_error_rate:.0%}); "
                          f"reasons are in {manifest['errors']}")
