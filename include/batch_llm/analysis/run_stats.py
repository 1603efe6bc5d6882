"""What a finished run's summary and files say, read once: the facts the doctor's rules and the report use.

A run's ``summary.json`` (:class:`~batch_llm.manifests.RunSummary`) holds its stage manifests; :class:`RunStats`
gathers from it the shard metrics, the engine's recorded settings, the device, and (streaming, bounded)
statistics read from the shards' files: token lengths (:class:`TokenStats`), shared prompt prefixes
(:class:`PrefixStats`) and error kinds. The doctor (``doctor.py``: rules) and the report (``report.py``:
rendering) both read this one object.
"""
from __future__ import annotations

import math
import os
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TypedDict

import numpy as np

from batch_llm.host.gpus import visible_gpus
from batch_llm.io.images import content_text
from batch_llm.io.storage import Location, exists, iter_jsonl
from batch_llm.manifests import (
    EngineRecord,
    EvaluateManifest,
    FetchManifest,
    FilterManifest,
    Phase,
    PlanManifest,
    QuantizeManifest,
    RunSummary,
    ShardManifest,
    ShardMetrics,
    ShardResult,
)

Shard = ShardManifest | ShardResult  # a summary's shard: its manifest, or (from XCom) its hand-off


def engine_record(shard: Shard) -> EngineRecord | None:
    """The engine a shard's manifest recorded (a hand-off names only the engine's kind)."""
    return shard.engine if isinstance(shard.engine, EngineRecord) else None


def engine_settings(shard: Shard) -> dict:
    rec = engine_record(shard)
    return dict(rec.settings) if rec else {}


def engine_kind(shard: Shard) -> str | None:
    engine = shard.engine  # a manifest's EngineRecord, or a hand-off's kind
    return engine.kind if isinstance(engine, EngineRecord) else engine


def shard_phases(shard: Shard) -> list[Phase]:
    """The shard's timeline (a hand-off carries none)."""
    return shard.phases if isinstance(shard, ShardManifest) else []


def model_dir(summary: RunSummary) -> str:
    """The model folder the shards served: the quantize stage's export, else the fetched folder ("" if neither)."""
    m = summary.manifests
    return (m.quantize.local_dir if m.quantize else "") or (m.fetch.local_dir if m.fetch else "")


def quantile(counts: Counter | dict, q: float) -> float | None:
    """Nearest-rank quantile of a value -> count table: numpy's inverted CDF, each value weighted by its count."""
    if not sum(counts.values()):
        return None
    values = np.fromiter(counts.keys(), dtype=float, count=len(counts))
    weights = np.fromiter(counts.values(), dtype=float, count=len(counts))
    return float(np.quantile(values, q, weights=weights, method="inverted_cdf"))


def mean_of(counts: Counter | dict) -> float | None:
    total = sum(counts.values())
    return sum(v * c for v, c in counts.items()) / total if total else None


@dataclass
class TokenStats:
    """Per-row token lengths read from the shards' ``outputs.jsonl`` (the rows that succeeded)."""

    prompt: Counter = field(default_factory=Counter)        # prompt tokens -> rows
    completion: Counter = field(default_factory=Counter)    # completion tokens -> rows
    reasoning: Counter = field(default_factory=Counter)     # thinking tokens -> rows (a reasoning parser's split)
    rows: int = 0                 # rows read
    rows_total: int = 0           # rows the manifests report as ok
    truncated: int = 0            # finish_reason "length": stopped by their max_tokens
    truncated_own: Counter = field(default_factory=Counter)  # of those, rows that set their own: max_tokens -> rows
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


def shard_order_of(summary: RunSummary) -> str:
    """The order of the rows inside the run's shards (``plan.shard_order_name``): the plan manifest's, or for a plan
    from before it named one, what its settings asked for."""
    if summary.manifests.plan.order:
        return summary.manifests.plan.order
    sharding = summary.config.get("sharding") or {}
    if not sharding.get("sort_by_length", True):
        return "input"
    return "budget, prefix, length" if sharding.get("group_prefixes") is True else "budget, length"


def read_token_stats(summary: RunSummary, options: dict | None = None, *, max_rows: int = 500_000,
                     batch_size: int | None = None, sort_by_length: bool | None = None) -> TokenStats:
    """Reads prompt/completion lengths row by row (streaming; at most ``max_rows`` spread over the shards,
    the first rows of each) and simulates the static batches of the transformers engine over them."""
    cfg = summary.config
    bs = batch_size or (cfg.get("engine") or {}).get("batch_size") or 16
    # rows grouped by prefix: batches cut as they come, as if unsorted
    sort = shard_order_of(summary) in ("budget, length", "history, length") if sort_by_length is None else sort_by_length
    shards = summary.manifests.shards
    st = TokenStats(batch_size=bs, rows_total=sum(s.metrics.ok for s in shards))
    per_shard = max(1000, max_rows // max(1, len(shards)))
    planned = {p.index: p.url for p in summary.manifests.plan.shards}
    for s in shards:
        if not s.outputs:
            continue
        path = Location(s.outputs, options or {}).path()
        if exists(path):
            cut = _add_shard_tokens(st, path, per_shard, sort)
            if cut and planned.get(s.shard):
                st.truncated_own.update(_own_budgets(Location(planned[s.shard], options or {}).path(), cut))
    return st


def _own_budgets(plan_shard, ids: set[str]) -> Iterator[int]:
    """The max_tokens that the rows ``ids`` of a planned shard set themselves (a request's own, an input
    column's), one per such row; rows that set none (``sampling.max_tokens`` applied) give nothing."""
    if not exists(plan_shard):
        return
    left = set(ids)
    for r in iter_jsonl(plan_shard):
        if str(r.get("id")) in left:
            left.discard(str(r.get("id")))
            params = r["params"] if "params" in r else r  # shards planned before row params: max_tokens alone
            if isinstance(params, dict) and params.get("max_tokens"):
                yield int(params["max_tokens"])
            if not left:
                return


def _add_shard_tokens(st: TokenStats, path, per_shard: int, sort: bool) -> set[str]:
    """One shard's rows (its first ``per_shard``) into the token statistics, and its static batches; returns the
    ids of its rows stopped by their max_tokens."""
    bs = st.batch_size
    sent: list[tuple[int, int]] = []
    cut: set[str] = set()
    for i, r in enumerate(iter_jsonl(path)):
        if i >= per_shard:
            break
        p, c = int(r.get("prompt_tokens") or 0), int(r.get("completion_tokens") or 0)
        st.prompt[p] += 1
        st.completion[c] += 1
        st.rows += 1
        if r.get("finish_reason") == "length":
            st.truncated += 1
            cut.add(str(r.get("id")))
        if "reasoning_tokens" in r:
            st.reasoning[int(r["reasoning_tokens"] or 0)] += 1
        if not r.get("cached"):
            sent.append((p, c))
    if sort:  # the planner sorts a shard by output budget, then prompt length (plan.shard_order); with one
        # budget for every row, the common case, that is prompt length, and batches are cut in that order
        sent.sort()
    for k in range(0, len(sent), bs):
        batch = sent[k:k + bs]
        st.padded_tokens += max(p for p, _ in batch) * len(batch)
        st.real_tokens += sum(p for p, _ in batch)
        st.decode_slots += max(c for _, c in batch) * len(batch)
        st.decode_used += sum(c for _, c in batch)
    return cut


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


def read_prefix_stats(summary: RunSummary, options: dict | None = None, *, max_rows: int = 400,
                      max_shards: int = 8) -> PrefixStats:
    shards = summary.manifests.plan.shards
    texts: list[str] = []
    systems: Counter = Counter()
    chosen = shards[:: max(1, math.ceil(len(shards) / max_shards))][:max_shards]
    per = max(1, max_rows // max(1, len(chosen)))
    for s in chosen:
        path = Location(s.url, options or {}).path()
        if not s.url or not exists(path):
            continue
        for i, r in enumerate(iter_jsonl(path)):
            if i >= per:
                break
            msgs = r.get("messages") or []
            texts.append("".join(f"<{m.get('role')}>{content_text(m.get('content'))}" for m in msgs))
            if msgs and msgs[0].get("role") == "system":
                systems[content_text(msgs[0].get("content"))] += 1
    st = PrefixStats(rows=len(texts))
    if texts:
        prefix = os.path.commonprefix(texts) if len(texts) > 1 else ""
        st.common_prefix_chars = len(_ROLE_TAG.sub("", prefix))  # the role tags are not prompt text
        if systems:
            text, n = systems.most_common(1)[0]
            st.system_share, st.system_chars = n / len(texts), len(text)
    return st


_ROLE_TAG = re.compile(r"<(?:system|user|assistant|tool|developer)>")


class ErrorReasons(TypedDict):
    """Why rows failed, from the plan's and the shards' errors files (reasons by kind, see ``_reason_kind``)."""

    plan: Counter[str]       # input rows the planner rejected, by reason
    infer: Counter[str]      # rows that failed in inference, by reason
    too_long: int            # of those, rows whose prompt was longer than the engine allows
    max_prompt_tokens: int   # the longest such prompt


def no_error_reasons() -> ErrorReasons:
    return ErrorReasons(plan=Counter(), infer=Counter(), too_long=0, max_prompt_tokens=0)


def read_error_reasons(summary: RunSummary, options: dict | None = None, *,
                       max_rows: int = 20_000) -> ErrorReasons:
    """The reasons of the plan's and the shards' error rows (at most ``max_rows`` of each)."""
    out = no_error_reasons()
    plan_errors = summary.manifests.plan.errors
    if plan_errors and exists(Location(plan_errors, options or {}).path()):
        for i, r in enumerate(iter_jsonl(Location(plan_errors, options or {}).path())):
            if i >= max_rows:
                break
            out["plan"][_reason_kind(r.get("reason") or "")] += 1
    n = 0
    for s in summary.manifests.shards:
        if not s.errors or not s.metrics.errors:
            continue
        path = Location(s.errors, options or {}).path()
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
    """GPUs of the pool: the argument, else $BATCH_LLM_GPUS ("0,1,2,3": ids, read as the GPU leases read it)."""
    if gpus is not None:
        return gpus
    if os.environ.get("BATCH_LLM_GPUS") is None:
        return None
    return len(visible_gpus()) or None


@dataclass
class RunStats:
    """One run's facts (see the module's docstring); build it with :func:`run_stats`."""

    summary: RunSummary
    cfg: dict                      # the configuration the run used, as the summary keeps it (JSON)
    shards: list[Shard]
    metrics: list[ShardMetrics]
    settings: dict
    kind: str
    device: str
    on_gpu: bool
    gpus: int | None
    tokens: TokenStats | None
    prefix: PrefixStats | None
    errors: ErrorReasons | None
    model_limit: int | None = None  # the model's own context limit (max_position_embeddings), when known
    options: dict = field(default_factory=dict)  # fsspec options for the files the summary names

    @property
    def plan(self) -> PlanManifest:
        return self.summary.manifests.plan

    @property
    def filter(self) -> FilterManifest:
        return self.summary.manifests.filter

    @property
    def evaluate(self) -> EvaluateManifest:
        return self.summary.manifests.evaluate

    @property
    def fetch(self) -> FetchManifest | None:
        return self.summary.manifests.fetch

    @property
    def quantize(self) -> QuantizeManifest | None:
        return self.summary.manifests.quantize

    def total(self, metric: str) -> float:
        """A shard metric (a :class:`ShardMetrics` field) summed over the shards."""
        return sum(getattr(m, metric) or 0 for m in self.metrics)

    @property
    def engine(self) -> tuple[str, str, dict]:
        """(kind, version, settings) the shards recorded, else the configured kind."""
        for s in self.shards:
            rec = engine_record(s)
            if rec and rec.settings:
                return rec.kind or "?", rec.version or "", dict(rec.settings)
        return self.engine_cfg.get("kind", "?"), "", {}

    @property
    def engine_cfg(self) -> dict:
        return self.cfg.get("engine") or {}

    @property
    def total_rows(self) -> int:
        return int(self.plan.valid or self.total("rows"))

    @property
    def tp(self) -> int:
        return int(self.settings.get("tensor_parallel_size") or self.engine_cfg.get("tensor_parallel_size") or 1)

    def engine_rows(self, m: ShardMetrics) -> int:
        """Requests a shard sent to the engine (rows less cache hits, duplicates folded)."""
        rows = m.rows - m.cached_rows - m.errors
        return max(0, min(rows, m.unique_prompts))

    def mean_seq_tokens(self) -> float | None:
        if self.tokens and self.tokens.rows:
            prompt, completion = mean_of(self.tokens.prompt), mean_of(self.tokens.completion)
            if prompt is not None and completion is not None:  # each row read counts in both
                return prompt + completion
        rows, ok = self.total("rows"), self.total("ok")
        if not rows or not ok:
            return None
        return self.total("input_tokens") / rows + self.total("output_tokens") / ok


def model_limit_of(summary: RunSummary, settings: dict) -> int | None:
    """The model's context limit: what the engine recorded (``model_context_limit`` in the shard's engine
    settings), else ``max_position_embeddings`` in the config.json of the model folder the run names, when
    that folder is on this machine."""
    v = settings.get("model_context_limit")
    if isinstance(v, int) and v > 0:
        return v
    from batch_llm.host.probes import model_context_limit

    m = summary.manifests
    for d in (m.quantize.local_dir if m.quantize else None, m.fetch.local_dir if m.fetch else None,
              (summary.config.get("model") or {}).get("ref")):
        if isinstance(d, str) and os.path.isdir(d):
            limit = model_context_limit(d)
            if limit:
                return limit
    return None


def run_stats(summary: RunSummary, *, gpus: int | None = None, tokens: TokenStats | None = None,
              prefix: PrefixStats | None = None, errors: ErrorReasons | None = None,
              options: dict | None = None, read_files: bool = True) -> RunStats:
    """The run's facts; statistics already read are passed in, the others read from the files the summary
    names (unless ``read_files`` is false). ``options``: fsspec options for those files."""
    cfg = summary.config
    shards = summary.manifests.shards
    metrics = [s.metrics for s in shards]
    settings = next((engine_settings(s) for s in shards if engine_settings(s)), {})
    kind = next((k for k in map(engine_kind, shards) if k), None) or (cfg.get("engine") or {}).get("kind") or "vllm"
    device = str(settings.get("device") or ("cuda" if kind == "lmdeploy" else ""))
    n_gpus = gpu_count(gpus)
    on_gpu = device.startswith("cuda") or (not device and bool(n_gpus))
    if read_files:  # token statistics even without shards: the report's tables draw them empty
        tokens = tokens or read_token_stats(summary, options)
    if read_files and shards:
        prefix = prefix or read_prefix_stats(summary, options)
        errors = errors or read_error_reasons(summary, options)
    return RunStats(summary=summary, cfg=cfg, shards=shards, metrics=metrics, settings=settings, kind=kind,
                device=device or "unknown device", on_gpu=on_gpu, gpus=n_gpus, tokens=tokens, prefix=prefix,
                errors=errors, model_limit=model_limit_of(summary, settings), options=options or {})
