"""The run report: one self-contained HTML page next to each published version's ``summary.json``.

``publish`` writes it; ``batch-llm report`` shows it. Everything is in the one file (plots rendered with
matplotlib's Agg backend to PNG and embedded as base64, CSS inline), so it opens from object storage, an
e-mail attachment or the Airflow UI alike. matplotlib comes with the ``report`` extra: without it the page
has the same sections with tables in place of the plots, and says which extra adds them. Sections:

- the doctor's findings (``batch_llm.analysis.doctor``): what to change, with the numbers
- rows by outcome: published, dropped by the content filter, invalid input, inference errors
- throughput: output tokens/s per shard
- time per shard: engine start against generation
- input and output token lengths (per row, from the shards' ``outputs.jsonl``)
- content-filter hits by list
- the content review's verdicts (``filter.review``): rows by verdict and by category, and what was done
- EvalScope scores, with the pipeline's previous partitions as a trend
- the shards (every one for small runs, the slowest for large ones), the configuration used

A 3-shard run gets one bar per shard; a 500-shard run gets distributions and percentiles instead, and its
tables are capped, so the page stays small either way.
"""
from __future__ import annotations

import base64
import contextlib
import importlib
import io
import logging
import math
import statistics
from dataclasses import dataclass
from types import ModuleType
from typing import ClassVar, TypedDict

import yaml
from markupsafe import Markup

from batch_llm.analysis.doctor import Finding, diagnose_run
from batch_llm.analysis.run_stats import RunStats, mean_of, quantile, run_stats, shard_phases
from batch_llm.analysis.templates import render
from batch_llm.io.storage import Location, exists, list_files, read_json, write_text_atomic
from batch_llm.manifests import QuantizeManifest, RunSummary

log = logging.getLogger("batch_llm.analysis.report")

REPORT_NAME = "report.html"
SHARD_BARS_MAX = 48        # up to this many shards: one bar per shard; above: distributions
SHARD_TABLE_MAX = 20       # up to this many shards: a table row each; above: the slowest SHARD_TABLE_TOP
SHARD_TABLE_TOP = 10
TREND_MAX = 30             # partitions on the score trend (the current one and those before it)
TREND_TABLE_MAX = 10
WORDS_PER_LIST = 8
DPI = 96

C_START, C_GEN, C_OTHER = "#e8894a", "#3f6fb5", "#c9ced6"
C_OK, C_DROP, C_INVALID, C_ERR = "#3c9a5f", "#e0a526", "#c8553d", "#8c2d2d"
ACTION_COLORS = {"flag": "#6c8ebf", "mask": "#e0a526", "drop": "#c8553d"}


def _export_label(quantize: QuantizeManifest) -> str:
    """How the report names the quantize stage's export: "AWQ W4A16", "RTN W4A16", "FP8_DYNAMIC"."""
    q = quantize.quantization or {}
    scheme = q.get("scheme") or "W4A16"
    method = q.get("method")
    return f"{method.upper()} {scheme}" if scheme == "W4A16" and method else scheme


# ------------------------------------------------------------------------------------------ entry points

def write_run_report(summary: RunSummary, version_dir: Location, pipeline_root: Location, *,
                     gpus: int | None = None) -> str:
    """Renders the run report into ``<version_dir>/report.html`` and returns its URL."""
    page = render_report(summary, pipeline_root=pipeline_root, options=version_dir.options, gpus=gpus)
    loc = version_dir.child(REPORT_NAME)
    write_text_atomic(loc.path(), page)
    return loc.url


NO_PLOTS = ("No plots but the timeline: matplotlib is not installed here; the report extra adds it "
            "(pip install 'batch-llm[report]').")


def render_report(summary: RunSummary, *, pipeline_root: Location | None = None, options: dict | None = None,
                  gpus: int | None = None) -> str:
    matplotlib = _matplotlib()
    opts = options or (pipeline_root.options if pipeline_root else {})
    run = run_stats(summary, gpus=gpus, options=opts)
    r = _Page(run, diagnose_run(run), pipeline_root, plots=matplotlib is not None)
    style = {"font.size": 8.5, "axes.spines.top": False, "axes.spines.right": False, "axes.grid": True,
             "grid.alpha": 0.25, "axes.axisbelow": True, "legend.frameon": True, "legend.framealpha": 0.85,
             "legend.edgecolor": "none", "axes.titlesize": 9.5,
             "axes.titleweight": "bold", "figure.dpi": DPI}
    sections = [("doctor", "What to change", _doctor), ("outcomes", "Rows by outcome", _outcomes),
                ("throughput", "Throughput", _throughput), ("time", "Time per shard", _time),
                ("timeline", "Timeline", _timeline),
                ("lengths", "Token lengths", _lengths), ("filter", "Content filter", _filter),
                ("review", "Content review", _review),
                ("scores", "EvalScope scores", _scores), ("shards", "Shards", _shards_table),
                ("config", "Configuration used", _config)]
    rendered = []
    with matplotlib.rc_context(style) if matplotlib else contextlib.nullcontext():
        for anchor, title, fn in sections:
            try:
                blocks = fn(r)
            except Exception as e:  # noqa: BLE001 - one broken section must not cost the whole report
                log.exception("report section %s failed", anchor)
                blocks = [Note(f"This section could not be rendered: {type(e).__name__}: {e}")]
            rendered.append(Section(anchor, title, blocks))
    return render("report.html.j2", h={**_header(r), "no_plots": "" if r.plots else NO_PLOTS}, sections=rendered)


def _matplotlib() -> ModuleType | None:
    """matplotlib, or None in a base install: the same sections then, with tables in place of the plots."""
    try:
        return importlib.import_module("matplotlib")
    except ImportError:
        return None


# ------------------------------------------------------------------------------------------ page blocks
# What a section hands the template (templates/report.html.j2 draws each kind): values are text, escaped
# there; a note that needs markup (bold, code) is built with Markup, which escapes what it formats in.
@dataclass(frozen=True)
class Figure:
    alt: str
    src: str          # a data: URI of the PNG
    kind: ClassVar[str] = "figure"


@dataclass(frozen=True)
class Svg:
    """A chart drawn as inline SVG markup (built here, its text escaped): explored by hovering, with no script."""
    svg: Markup
    legend: list      # (label, colour), drawn beside the chart, never on it
    kind: ClassVar[str] = "svg"


@dataclass(frozen=True)
class Table:
    head: list
    rows: list
    numeric: bool = False
    kind: ClassVar[str] = "table"


@dataclass(frozen=True)
class Note:
    text: str
    kind: ClassVar[str] = "note"


@dataclass(frozen=True)
class Columns:
    blocks: list
    kind: ClassVar[str] = "columns"


@dataclass(frozen=True)
class Details:
    summary: str
    text: str
    kind: ClassVar[str] = "details"


@dataclass(frozen=True)
class Findings:
    findings: list
    kind: ClassVar[str] = "findings"


@dataclass(frozen=True)
class Section:
    anchor: str
    title: str
    blocks: list


# ------------------------------------------------------------------------------------------ run facts
@dataclass
class _Page:
    """What a report page draws: the run's facts, the doctor's findings, and where earlier runs are."""

    run: RunStats
    findings: list[Finding]
    pipeline_root: Location | None
    plots: bool = True  # matplotlib is installed: sections draw their plots (else their tables only)


def _header(r: _Page) -> dict:
    s = r.run.summary
    read = r.run.plan.rows_read
    out_tok, gen = r.run.total("output_tokens"), r.run.total("generate_seconds")
    metric = (r.run.cfg.get("evaluate") or {}).get("metric", "Rouge-L-F")
    score = r.run.evaluate.metrics.get(metric)
    errors = (r.run.plan.invalid or 0) + (r.run.filter.inference_error_rows or r.run.total("errors"))
    tiles = [("rows read", _num(read)), ("published", _num(s.rows_published)),
             ("errors", _num(errors)), ("dropped by filter", _num(r.run.filter.summary.rows_dropped)),
             ("shards", _num(len(r.run.shards))), ("output tokens", _num(out_tok)),
             ("output tok/s per engine", _num(out_tok / gen, 1) if gen else "–"),
             ("engine-seconds", _num(r.run.total("seconds"))), (metric, f"{score:.4f}" if score is not None else "–")]
    if (r.run.cfg.get("sampling") or {}).get("output_schema"):  # structured outputs: how many fit the schema
        tiles.insert(3, ("invalid outputs (schema)", _num(r.run.total("invalid_outputs"))))
    if r.run.plan.capped:
        tiles.insert(3, ("rows capped (max_tokens_cap)", _num(r.run.plan.capped)))
    thinking = r.run.total("reasoning_tokens")
    if thinking:  # a reasoning model: the share of the generated tokens spent thinking, not answering
        tiles.insert(6, ("thinking tokens", f"{_num(thinking)} ({thinking / out_tok:.0%} of output)" if out_tok
                         else _num(thinking)))
    unfinished = r.run.total("thinking_unfinished")
    if unfinished:
        tiles.insert(3, ("rows whose thinking never ended", _num(unfinished)))
    cached, prompt = r.run.total("cached_prompt_tokens"), r.run.total("input_tokens")
    if cached:  # the engine's prefix cache: prompt tokens it did not compute again
        tiles.insert(-3, ("prompt tokens from prefix cache", f"{_num(cached)} ({cached / prompt:.0%})"))
    kind, version, st = r.run.engine
    fetched, quantized = r.run.fetch, r.run.quantize
    model = (fetched.id if fetched else None) or (r.run.cfg.get("model") or {}).get("ref", "?")
    rev = (fetched.revision if fetched else None) or (r.run.cfg.get("model") or {}).get("revision", "")
    samp = r.run.cfg.get("sampling") or {}
    eng_bits = ", ".join(f"{k} {st[k]}" for k in ("device", "max_num_seqs", "max_model_len", "gpu_memory_utilization",
                                                   "replicas", "kv_cache_dtype", "enable_prefix_caching", "batch_size")
                         if k in st)
    facts = [
        ("model", f"{model} @ {rev}" + (f" ({_export_label(quantized)})" if quantized and quantized.quantized
                                         else "")),
        ("engine", f"{kind} {version}" + (f" ({eng_bits})" if eng_bits else "")),
        ("sampling", f"max_tokens {samp.get('max_tokens')}, temperature {samp.get('temperature')}, "
                     f"seed {samp.get('seed')}" + (", output schema" + _guided_label(samp.get("guided_decoding", True))
                                                    if samp.get("output_schema") else "")),
        ("input", f"{r.run.plan.input} ({r.run.plan.format})"),
        ("order in a shard", _order_label(r.run.plan)),  # plan.shard_order_name; plans before it named none
        ("dataset", s.dataset), ("errors", s.errors),
        ("EvalScope report", r.run.evaluate.report_html),
    ]
    paths = ("dataset", "errors", "EvalScope report", "input")
    return {"pipeline": s.pipeline, "partition": s.partition,
            "run_id": s.run_id, "published_at": s.published_at.isoformat(),
            "warnings": sum(f.severity == "warning" for f in r.findings), "findings": len(r.findings),
            "tiles": tiles, "facts": [(k, v, k in paths) for k, v in facts if v]}


# ------------------------------------------------------------------------------------------ sections
def _doctor(r: _Page) -> list:
    if not r.findings:
        return [Note("The doctor found nothing to change: no check's numbers are out of bounds.")]
    return [Findings(r.findings),
            Note(Markup("The same list: <code>batch-llm doctor &lt;this folder&gt;</code>."))]


def _outcomes(r: _Page) -> list:
    fs = r.run.filter.summary
    invalid = int(r.run.plan.invalid or 0)
    infer_err = int(r.run.filter.inference_error_rows)
    dropped = int(fs.rows_dropped or 0)
    ok = int(r.run.summary.rows_published or 0)
    read = int(r.run.plan.rows_read or (ok + dropped + invalid + infer_err))
    rows = [("published", ok, C_OK), ("dropped by content filter", dropped, C_DROP),
            ("invalid input (plan)", invalid, C_INVALID), ("inference errors", infer_err, C_ERR)]
    share = lambda v: f"{v:,} ({v / read:.1%})" if read else f"{v:,}"  # noqa: E731
    shown: Figure | Table
    if r.plots:
        fig, ax = _figure(7.2, 1.9)
        labels = [k for k, _, _ in rows][::-1]
        vals = [v for _, v, _ in rows][::-1]
        ax.barh(labels, vals, color=[c for _, _, c in rows][::-1], height=0.6)
        top = max(vals) or 1
        for y, v in enumerate(vals):
            ax.text(v + top * 0.01, y, share(v), va="center", fontsize=8)
        ax.set_xlim(0, top * 1.22)
        ax.set_xlabel(f"rows (of {read:,} read)")
        _integer_axis(ax.xaxis)
        ax.grid(axis="y", visible=False)
        shown = _img(fig, "rows by outcome")
    else:
        shown = _table(["outcome", f"rows (of {read:,} read)"], [[k, share(v)] for k, v, _ in rows])
    extra = []
    if fs.rows_masked:
        extra.append(f"{fs.rows_masked:,} published rows had words masked")
    if fs.rows_flagged:
        extra.append(f"{fs.rows_flagged:,} were flagged")
    cached = int(r.run.total("cached_rows"))
    if cached:
        extra.append(f"{cached:,} rows came from the result cache")
    return [shown] + ([Note("; ".join(extra) + ".")] if extra else [])


def _throughput(r: _Page) -> list:
    pts = [(s.shard, m.output_tokens_per_second or 0.0) for s, m in zip(r.run.shards, r.run.metrics)
           if m.generate_seconds]
    if not pts:
        return [Note("No shard ran the engine (no shards, or every row came from the cache).")]
    idx, tps = [p[0] for p in pts], [p[1] for p in pts]
    med = statistics.median(tps)
    if len(pts) <= SHARD_BARS_MAX and not r.plots:
        return [_table(["shard", "output tokens / s"], [[i, _num(v, 1)] for i, v in pts], numeric=True),
                Note(f"median {med:,.1f} output tokens per second of generation.")]
    if len(pts) <= SHARD_BARS_MAX:
        fig, ax = _figure(7.2, 2.6)
        ax.bar([str(i) for i in idx], tps, color=C_GEN, width=0.7)
        ax.axhline(med, color="#333", lw=0.8, ls="--", label=f"median {med:,.1f}")
        if len(pts) <= 12:
            for x, v in enumerate(tps):
                ax.text(x, v, f"{v:,.0f}", ha="center", va="bottom", fontsize=7.5)
        _thin_xticks(ax, len(pts))
        ax.set_xlabel("shard")
        ax.set_ylabel("output tokens / s")
        ax.set_title("output tokens per second of generation, per shard")
        _legend_beside(ax)
        return [_img(fig, "tokens per second per shard")]
    table = _pct_table([("output tokens / s", tps)], note="slowest shards are listed under Shards")
    if not r.plots:
        return table
    fig, (a1, a2) = _figure(7.6, 2.6, ncols=2)
    a1.hist(tps, bins=min(40, max(5, len(tps) // 10)), color=C_GEN)
    a1.axvline(med, color="#333", lw=0.8, ls="--", label=f"median {med:,.1f}")
    a1.set_xlabel("output tokens / s")
    a1.set_ylabel("shards")
    a1.set_title(f"distribution over {len(tps):,} shards")
    _legend_beside(a1)
    a2.scatter(idx, tps, s=5, color=C_GEN, alpha=0.7, lw=0)
    a2.axhline(med, color="#333", lw=0.8, ls="--")
    a2.set_xlabel("shard")
    a2.set_ylabel("output tokens / s")
    a2.set_title("by shard (stragglers stand out)")
    return [_img(fig, "tokens per second per shard"), *table]


PHASE_COLORS = {"spawn": "#b9c2cf", "imports": "#8e9aab", "read": "#6cb2a8", "engine": C_START,
                "tokenize": "#d9b44a", "first_token": "#9c7fc0", "generation": C_GEN, "merge": "#5d9b52",
                "commit": "#2f6b3a"}
TIMELINE_SHARDS_MAX = 40   # more shards: the first ones by start time, and a note


def _timeline(r: _Page) -> list:
    """Shards × time: each shard's phases as bars from its manifest's ``phases`` (wall clock, one axis for the
    run); engine start overlaps tokenizing, so it is drawn on the lower half of the row."""
    from batch_llm.analysis.timeline import PHASES, largest_avoidable, phase_seconds

    shards = sorted(((s.shard, phases) for s in r.run.shards if (phases := shard_phases(s))),
                    key=lambda sp: min(p.start for p in sp[1]))
    if not shards:
        return [Note("No shard recorded a timeline (manifests written before timelines existed).")]
    shown = shards[:TIMELINE_SHARDS_MAX]
    plot = [timeline_svg(shown, PHASES)]  # no matplotlib needed: the base install gets it too
    totals: dict[str, float] = {}
    for _, phases in shards:
        for name, sec in phase_seconds(phases).items():
            totals[name] = totals.get(name, 0.0) + sec
    rows = [[name, _num(totals[name], 1)] for name in PHASES if name in totals]
    top = largest_avoidable(phases for _, phases in shards)
    note = (Markup("Largest avoidable phase: <b>{}</b>, {} s ({:.0%} of the shards' wall time); the doctor says "
                   "what to change.").format(top[0], _num(top[1], 1), top[2]) if top else Markup(""))
    more = f" The first {len(shown)} of {len(shards)} shards are drawn." if plot and len(shards) > len(shown) else ""
    return [*plot, _table(["phase", "seconds, all shards"], rows), Note(note + more)]


def timeline_svg(shown: list, phase_order: tuple, width: int = 900) -> Svg:
    """The shards' phases as an SVG Gantt chart: hovering a bar shows its shard, phase, seconds and span (an SVG
    ``<title>``), and the bar is outlined (CSS ``:hover``); a row's phases are listed on hovering its label. No
    script: the report's Content-Security-Policy allows none, and the page works offline. Engine start overlaps
    tokenizing, so it is drawn on the lower half of the row. The legend is HTML beside the chart."""
    t0 = min(p.start for _, phases in shown for p in phases)
    span = max(max(p.end for _, phases in shown for p in phases) - t0, 1e-3)
    left, right, top, row_h = 56, 12, 8, 22
    plot_w = width - left - right
    height = top + row_h * len(shown) + 34
    x = lambda t: left + plot_w * (t - t0) / span  # noqa: E731 - seconds since the epoch to x
    parts = [Markup('<svg class="chart timeline" viewBox="0 0 {w} {h}" width="{w}" height="{h}" role="img" '
                    'aria-label="run timeline: each shard\'s phases, by seconds since the first shard began" '
                    'xmlns="http://www.w3.org/2000/svg">').format(w=width, h=height)]
    for tick in _ticks(span):
        tx = left + plot_w * tick / span
        parts.append(Markup('<line class="grid" x1="{x:.1f}" x2="{x:.1f}" y1="{t}" y2="{b}"/><text class="tick" '
                            'x="{x:.1f}" y="{ty}" text-anchor="middle">{v}</text>').format(
            x=tx, t=top, b=height - 26, ty=height - 14, v=_num(tick, 1 if span < 10 else 0)))
    for row, (index, phases) in enumerate(shown):
        y = top + row * row_h
        secs = phase_seconds_text(phases)
        parts.append(Markup('<g class="row"><text class="label" x="{lx}" y="{ty}" text-anchor="end">shard {i}'
                            '<title>shard {i}: {secs}</title></text>').format(lx=left - 6, ty=y + row_h * 0.65,
                                                                            i=index, secs=secs))
        for p in phases:
            lower = p.name == "engine"
            bx, bw = x(p.start), max(x(p.end) - x(p.start), 1.0)
            parts.append(Markup('<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" fill="{c}">'
                                '<title>shard {i} · {n}: {d} s ({a} s → {b} s)</title></rect>').format(
                x=bx, y=y + (row_h * 0.5 if lower else row_h * 0.1), w=bw, h=row_h * 0.4,
                c=PHASE_COLORS.get(p.name, C_OTHER), i=index, n=p.name, d=_num(p.end - p.start, 2),
                a=_num(p.start - t0, 1), b=_num(p.end - t0, 1)))
        parts.append(Markup("</g>"))
    parts.append(Markup('<text class="axis" x="{x}" y="{y}" text-anchor="middle">seconds since the first shard '
                        'began</text></svg>').format(x=left + plot_w / 2, y=height - 1))
    names = {p.name for _, phases in shown for p in phases}
    legend = [(n, PHASE_COLORS.get(n, C_OTHER)) for n in sorted(names, key=lambda n: phase_order.index(n)
                                                                 if n in phase_order else 99)]
    return Svg(Markup("").join(parts), legend)


def phase_seconds_text(phases: list) -> str:
    from batch_llm.analysis.timeline import phase_seconds

    return ", ".join(f"{n} {_num(sec, 1)} s" for n, sec in phase_seconds(phases).items())


def _ticks(span: float, most: int = 8) -> list[float]:
    """Round tick values from 0 to ``span`` seconds, at most ``most`` + 1 of them."""
    raw = span / most
    step = next(m * 10 ** e for e in range(-3, 8) for m in (1, 2, 5) if m * 10 ** e >= raw)
    return [i * step for i in range(int(span // step) + 1)]


def _time(r: _Page) -> list:
    rows = []
    for s, m in zip(r.run.shards, r.run.metrics):
        start_s, gen_s = m.engine_start_seconds or 0.0, m.generate_seconds or 0.0
        total = m.seconds or 0.0
        rows.append((s.shard, start_s, gen_s, max(0.0, total - start_s - gen_s), total))
    if not rows:
        return [Note("No shard manifests in this summary.")]
    many = len(rows) > SHARD_BARS_MAX
    if many:
        rows.sort(key=lambda t: t[4])
    start, gen, other = [t[1] for t in rows], [t[2] for t in rows], [t[3] for t in rows]
    shares = [t[1] / t[4] for t in rows if t[4]]
    note = f"engine start is a median {statistics.median(shares):.0%} of a shard's time" if shares else ""
    img: Figure | Table | None
    if r.plots:
        img = _time_plot(rows, many)
    elif many:
        img = None
    else:
        img = _table(["shard", "engine start s", "generation s", "other s", "total s"],
                     [[t[0], *(_num(v, 1) for v in t[1:])] for t in rows], numeric=True)
    if not many:
        total = sum(t[4] for t in rows)
        return [img, Note(f"{note}; over all shards: {_num(sum(start), 1)} s engine start, "
                          f"{_num(sum(gen), 1)} s generation, {_num(sum(other), 1)} s other, {_num(total, 1)} s in all.")]
    return [*([img] if img else []), *_pct_table([("engine start (s)", start), ("generation (s)", gen),
                                                  ("other (s)", other), ("shard total (s)", [t[4] for t in rows])],
                                                 note=note)]


def _time_plot(rows: list[tuple], many: bool) -> Figure:
    x = list(range(len(rows)))
    start, gen, other = [t[1] for t in rows], [t[2] for t in rows], [t[3] for t in rows]
    fig, ax = _figure(7.2, 2.7)
    kw = dict(width=1.0, linewidth=0) if many else dict(width=0.7)
    ax.bar(x, start, color=C_START, label="engine start", **kw)
    ax.bar(x, gen, bottom=start, color=C_GEN, label="generation", **kw)
    ax.bar(x, other, bottom=[a + b for a, b in zip(start, gen)], color=C_OTHER,
           label="other (tokenize, cache, commit)", **kw)
    if many:
        ax.set_xlabel(f"{len(rows):,} shards, sorted by time")
        ax.set_xticks([])
        ax.set_xlim(-0.5, len(rows) - 0.5)
    else:
        ax.set_xticks(x, [str(t[0]) for t in rows])
        _thin_xticks(ax, len(rows))
        ax.set_xlabel("shard")
    ax.set_ylabel("seconds")
    ax.set_title("where each shard's time went")
    _legend_beside(ax)
    ax.set_ylim(0, max(t[4] for t in rows) or 1)
    return _img(fig, "engine start and generation time per shard")


def _lengths(r: _Page) -> list:
    t = r.run.tokens
    if not t or not t.rows:  # None: the summary's files were not read
        return [Note("No output rows to measure.")]
    max_tokens = (r.run.cfg.get("sampling") or {}).get("max_tokens")
    plot = [_lengths_plot(t, max_tokens)] if r.plots else []
    src = f"{t.rows:,} rows" + (f" (the first rows of each shard: {t.rows:,} of {t.rows_total:,})" if t.sampled else "")
    trunc = f"; {t.truncated:,} completions ({t.truncated / t.rows:.0%}) stopped at max_tokens" if t.truncated else ""
    table = _table(["", "mean", "p50", "p95", "p99", "max"],
                   [[name, _num(mean_of(c), 1), _num(quantile(c, .5)), _num(quantile(c, .95)), _num(quantile(c, .99)),
                     _num(max(c))] for name, c in (("input tokens", t.prompt), ("output tokens", t.completion),
                                                   ("thinking tokens", t.reasoning)) if c])
    return [*plot, table, Note(f"From {src}{trunc}.")]


def _lengths_plot(t, max_tokens: int | None) -> Figure:
    fig, (a1, a2) = _figure(7.6, 2.5, ncols=2)
    for ax, counts, color, title in ((a1, t.prompt, C_START, "input (prompt) tokens"),
                                     (a2, t.completion, C_GEN, "output (completion) tokens")):
        _hist_counts(ax, counts, color)
        for q, ls in ((0.5, "--"), (0.95, ":")):
            v = quantile(counts, q)
            ax.axvline(v, color="#333", lw=0.8, ls=ls, label=f"p{int(q * 100)} {v:,.0f}")
        ax.set_title(title)
        ax.set_ylabel("rows")
    if max_tokens:
        a2.axvline(max_tokens, color=C_INVALID, lw=1, label=f"max_tokens {max_tokens}")
    _legend_beside(a1)
    _legend_beside(a2)
    return _img(fig, "input and output token length histograms")


def _filter(r: _Page) -> list:
    fs = r.run.filter.summary
    if fs.enabled is False or not (r.run.cfg.get("filter") or {}).get("enabled", True):
        return [Note(f"The content filter was off ({_num(fs.rows_scanned)} rows passed unscanned).")]
    lists = fs.lists or [{"name": k, "action": "?"} for k in fs.hits_per_list]
    hits = fs.hits_per_list
    counts = f"{_num(fs.rows_scanned)} rows scanned, {_num(fs.rows_affected)} affected " \
             f"({_num(fs.rows_masked)} masked, {_num(fs.rows_flagged)} flagged, " \
             f"{_num(fs.rows_dropped)} dropped)"
    if not sum(hits.values()):
        return [Note(f"No hits in {len(lists)} list(s): {counts}.")]
    plot = [_filter_plot(lists, hits)] if r.plots else []
    per_word = fs.hits_per_word
    rows = []
    for lst in lists:
        words = sorted((per_word.get(lst["name"]) or {}).items(), key=lambda kv: -kv[1])
        shown = ", ".join(f"{w} ({n})" for w, n in words[:WORDS_PER_LIST])
        more = f" and {len(words) - WORDS_PER_LIST} more" if len(words) > WORDS_PER_LIST else ""
        rows.append([lst["name"], lst.get("action", ""), _num(hits.get(lst["name"], 0)), shown + more or "–"])
    return [*plot, _table(["list", "action", "hits", "top words"], rows), Note(f"{counts}.")]


def _filter_plot(lists: list[dict], hits: dict) -> Figure:
    from matplotlib.patches import Patch

    names = [lst["name"] for lst in lists]
    vals = [hits.get(n, 0) for n in names]
    fig, ax = _figure(7.2, max(1.4, 0.32 * len(names) + 0.7))
    ax.barh(names[::-1], vals[::-1], color=[ACTION_COLORS.get(lst.get("action") or "", "#888") for lst in lists][::-1],
            height=0.6)
    for y, v in enumerate(vals[::-1]):
        ax.text(v, y, f" {v:,}", va="center", fontsize=8)
    ax.set_xlim(0, max(vals) * 1.15)
    ax.set_xlabel("hits")
    ax.set_title("content-filter hits by list")
    ax.grid(axis="y", visible=False)
    used = sorted({lst["action"] for lst in lists if lst.get("action") in ACTION_COLORS})
    ax.legend(handles=[Patch(color=ACTION_COLORS[a], label=a) for a in used], loc="upper left",
              bbox_to_anchor=(1.0, 1.0), title="action", fontsize=7.5)
    _integer_axis(ax.xaxis)
    return _img(fig, "content filter hits by list")


def _review(r: _Page) -> list:
    """The content review by a model (``filter.review``): rows by verdict and by category, what was done."""
    rv = r.run.filter.summary.review
    if rv is None:
        return [Note("No content review by a model (filter.review is not set).")]
    n = rv.rows_reviewed or 1
    verdicts = [[v, _num(rv.verdicts.get(v, 0)), f"{rv.verdicts.get(v, 0) / n:.1%}"]
                for v in ("safe", "unsafe", "error") if v in rv.verdicts]
    cats = [[c, _num(k)] for c, k in sorted(rv.categories.items(), key=lambda kv: -kv[1])]
    note = (f"{_num(rv.rows_reviewed)} rows reviewed by {rv.model or 'the review model'} ({rv.task}): "
            f"{_num(rv.rows_flagged)} flagged, {_num(rv.rows_masked)} masked, {_num(rv.rows_dropped)} dropped; "
            f"{_num(rv.requests)} review requests ({_num(rv.cached_requests)} from the result cache), "
            f"{_num(rv.input_tokens)} prompt and {_num(rv.output_tokens)} verdict tokens.")
    blocks: list = [_table(["verdict", "rows", "share"], verdicts)]
    if cats:
        blocks.append(_table(["category", "rows"], cats))
    return [*blocks, Note(note)]


def _scores(r: _Page) -> list:
    metrics = r.run.evaluate.metrics
    metric = (r.run.cfg.get("evaluate") or {}).get("metric", "Rouge-L-F")
    min_score = (r.run.cfg.get("evaluate") or {}).get("min_score")
    history = score_history(r.run.summary, r.pipeline_root, r.run.options) if r.pipeline_root else \
        [ScorePoint(partition=r.run.summary.partition, run_id=r.run.summary.run_id, metrics=metrics,
                    num_samples=r.run.evaluate.num_samples, current=True)]
    scored = [h for h in history if h["metrics"]]
    if not scored:
        why = r.run.evaluate.skipped or "no scores recorded"
        return [Note(f"EvalScope scoring was skipped: {why}.")]
    names = [metric] + [m for m in ("Rouge-1-F", "Rouge-2-F", "Rouge-L-F", "bleu-4", "bleu-1")
                        if m != metric and any(m in h["metrics"] for h in scored)]
    names = [n for n in names if any(n in h["metrics"] for h in scored)][:4] or \
        [k for k, v in metrics.items() if isinstance(v, (int, float))][:4]
    plot = [_scores_plot(scored, names, min_score)] if r.plots else []
    prev = next((h for h in reversed(scored) if not h.get("current")), None)
    rows = [[name, f"{v:.4f}", _delta(v, prev["metrics"].get(name) if prev else None)] for name, v in metrics.items()
            if isinstance(v, (int, float))]
    tables = [_table(["metric", "this run", f"Δ vs {prev['partition']}" if prev else "Δ"], rows)] if rows else []
    trend_rows = [[h["partition"] + (" (this run)" if h.get("current") else ""), _num(h.get("num_samples")),
                   f"{h['metrics'][metric]:.4f}" if h["metrics"].get(metric) is not None else "–"]
                  for h in scored[::-1][:TREND_TABLE_MAX]]
    if len(scored) > 1:
        tables.append(_table(["partition", "samples", metric], trend_rows))
    rep = r.run.evaluate.report_html
    link = [Note(Markup("EvalScope's own report: <code>{}</code>").format(rep))] if rep else []
    n, pop = r.run.evaluate.num_samples, r.run.evaluate.rows_with_references
    sample = [Note(f"These scores are of a sample: {_num(n)} of the {_num(pop)} rows with a reference answer (seeded "
                   f"by evaluate.sample_seed = {r.run.evaluate.sample_seed}; the same seed scores the same "
                   "rows).")] if n and pop and n < pop else []
    return [*plot, *sample, Columns(tables), *link]


def _scores_plot(scored: list[ScorePoint], names: list[str], min_score: float | None) -> Figure:
    fig, ax = _figure(7.2, 2.6)
    x = list(range(len(scored)))
    for k, name in enumerate(names):
        ys = [h["metrics"].get(name) for h in scored]
        ax.plot(x, [math.nan if y is None else y for y in ys], marker="o", ms=4 if k else 5,
                lw=2 if k == 0 else 1, label=name, alpha=1 if k == 0 else 0.6)
    cur = [i for i, h in enumerate(scored) if h.get("current")]
    if cur and scored[cur[0]]["metrics"].get(names[0]) is not None:
        ax.scatter([cur[0]], [scored[cur[0]]["metrics"][names[0]]], s=90, facecolors="none", edgecolors="#111",
                   lw=1.2, zorder=5, label="this run")
    if min_score is not None:
        ax.axhline(min_score, color=C_INVALID, ls="--", lw=1, label=f"min_score {min_score}")
    ax.set_xticks(x, [h["partition"] for h in scored], rotation=30 if len(scored) > 4 else 0,
                  ha="right" if len(scored) > 4 else "center")
    _thin_xticks(ax, len(scored))
    ax.set_xlim(-0.5, len(scored) - 0.5)
    values = [v for h in scored for n in names if isinstance(v := h["metrics"].get(n), (int, float))]
    ax.set_ylim(0, max(values, default=1.0) * 1.2 or 1.0)
    ax.set_title(f"EvalScope scores, this run and the {len(scored) - 1} partition(s) before it"
                 if len(scored) > 1 else "EvalScope scores (no earlier partitions to compare with)")
    _legend_beside(ax)
    return _img(fig, "EvalScope score trend")


class ScorePoint(TypedDict):
    """One partition's scores on the trend."""

    partition: str
    run_id: str
    metrics: dict[str, float]
    num_samples: int | None
    current: bool        # this run's own scores


def score_history(summary: RunSummary, pipeline_root: Location, options: dict | None = None,
                  limit: int = TREND_MAX) -> list[ScorePoint]:
    """The scores of the pipeline's published partitions up to this one (each ``<partition>/_CURRENT.json``
    → version → ``summary.json``), oldest first; this run's own scores stand for its partition."""
    current = summary.partition
    # newest first, and only until the trend is full: a pipeline with years of daily partitions costs `limit`
    # pointer checks, not one per partition (each a request on object storage)
    earlier = sorted((d for d in list_files(pipeline_root.path())
                      if d.name not in ("runs", "_cache") and d.name < current), key=lambda d: d.name, reverse=True)
    names: list[str] = []
    for d in earlier:
        if len(names) >= limit - 1:
            break
        if exists(d / "_CURRENT.json"):
            names.append(d.name)
    out: list[ScorePoint] = []
    for name in reversed(names):
        try:
            ptr = read_json(pipeline_root.child(name, "_CURRENT.json").path())
            summ = RunSummary.read(Location(ptr["version"], options or pipeline_root.options).path())
        except (OSError, KeyError, ValueError):  # pydantic's ValidationError is a ValueError
            continue  # a version removed meanwhile, or a pointer without a summary: no point on the trend
        ev = summ.manifests.evaluate
        out.append(ScorePoint(partition=name, run_id=summ.run_id, metrics=ev.metrics, num_samples=ev.num_samples,
                              current=False))
    ev = summary.manifests.evaluate
    out.append(ScorePoint(partition=current or "this run", run_id=summary.run_id, metrics=ev.metrics,
                          num_samples=ev.num_samples, current=True))
    return out


def _shards_table(r: _Page) -> list:
    if not r.run.shards:
        return [Note("No shard manifests in this summary.")]
    pairs = list(zip(r.run.shards, r.run.metrics))
    if len(pairs) > SHARD_TABLE_MAX:
        pairs = sorted(pairs, key=lambda p: -(p[1].seconds or 0))[:SHARD_TABLE_TOP]
        head = f"The {SHARD_TABLE_TOP} slowest of {len(r.run.shards):,} shards."
    else:
        head = ""
    rows = [[s.shard, _num(m.rows), _num(m.ok), _num(m.errors), _num(m.cached_rows), _num(m.input_tokens),
             _num(m.output_tokens), _num(m.engine_start_seconds, 1), _num(m.generate_seconds, 1), _num(m.seconds, 1),
             _num(m.output_tokens_per_second, 1)]
            for s, m in pairs]
    errs = sum(1 for m in r.run.metrics if m.errors)
    note = f"{errs:,} shard(s) have error rows; their reasons are in each shard's errors.jsonl." if errs else ""
    table = _table(["shard", "rows", "ok", "errors", "cached", "input tok", "output tok", "start s", "gen s",
                    "total s", "tok/s"], rows, numeric=True)
    return ([Note(head)] if head else []) + [table] + ([Note(note)] if note else [])


def _config(r: _Page) -> list:
    text = yaml.safe_dump(r.run.cfg, sort_keys=False, allow_unicode=True, default_flow_style=False, width=100)
    return [Details("the pipeline configuration this run used (YAML, Params applied)", text)]


# ------------------------------------------------------------------------------------------ helpers
def _figure(w: float, h: float, ncols: int = 1):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(w, h), dpi=DPI, layout="constrained")
    return fig, fig.subplots(1, ncols)


def _img(fig, alt: str) -> Figure:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, metadata={"Software": None})
    data = base64.b64encode(buf.getvalue()).decode("ascii")
    return Figure(alt, f"data:image/png;base64,{data}")


def _legend_beside(ax) -> None:
    """The chart's legend to the right of its plot, outside it (the constrained layout makes room), so that it
    covers no bar, point or line whatever the data."""
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize=7.5)


def _hist_counts(ax, counts, color: str) -> None:
    values = sorted(counts)
    lo, hi = values[0], values[-1]
    bins = max(1, min(40, int(hi - lo) + 1))
    ax.hist(values, weights=[counts[v] for v in values], bins=bins, range=(lo - 0.5, hi + 0.5), color=color)


def _integer_axis(axis) -> None:
    from matplotlib.ticker import MaxNLocator

    axis.set_major_locator(MaxNLocator(integer=True))


def _thin_xticks(ax, n: int, most: int = 16) -> None:
    if n > most:
        step = math.ceil(n / most)
        for i, label in enumerate(ax.get_xticklabels()):
            label.set_visible(i % step == 0)


def _pct_table(series: list[tuple[str, list[float]]], note: str = "") -> list:
    rows = []
    for name, vals in series:
        c = sorted(vals)
        if not c:
            continue
        q = lambda p, c=c: c[min(len(c) - 1, max(0, math.ceil(p * len(c)) - 1))]
        rows.append([name, _num(c[0], 1), _num(q(.05), 1), _num(q(.5), 1), _num(q(.95), 1), _num(c[-1], 1)])
    return [_table(["", "min", "p5", "p50", "p95", "max"], rows, numeric=True)] + ([Note(f"{note}.")] if note else [])


def _table(head: list[str], rows: list[list], numeric: bool = False) -> Table:
    return Table(head, rows, numeric)


def _delta(v, prev) -> str:
    if not isinstance(prev, (int, float)):
        return "–"
    d = v - prev
    return f"{d:+.4f}" if d else "±0"


def _num(x, digits: int = 0) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if isinstance(x, (int, float)):
        return f"{x:,.{digits}f}" if digits and not float(x).is_integer() else f"{x:,.0f}"
    return str(x)


def _order_label(plan) -> str | None:
    """The order inside the shards (a PlanManifest's), with the length history it read where it read one."""
    h = plan.length_history
    if not plan.order or not h:
        return plan.order
    return (f"{plan.order} (expected lengths from {_num(h.get('files'))} earlier shard records, "
            f"{_num(h.get('groups'))} prompt groups; {_num(h.get('rows_estimated'))} rows estimated)")


def _guided_label(mode: object) -> str:
    """How the outputs met the schema (sampling.guided_decoding)."""
    if mode == "fallback":
        return " (decoded freely, the misses again under it)"
    return " (guided decoding)" if mode else " (checked only)"


__all__ = ["REPORT_NAME", "render_report", "score_history", "write_run_report"]
