"""``batch-llm``: the pipeline without Airflow, on one machine, with the same stage functions.

::

    batch-llm validate dags/pipelines/demo.yaml
    batch-llm run dags/pipelines/demo.yaml --ds 2026-11-30 --set sampling.max_tokens=64
    batch-llm run-shard dags/pipelines/demo.yaml --shard 1 --run-id cli__2026-11-30
    batch-llm report var/output/batch_llm_demo/dt=2026-11-30
    batch-llm doctor dags/pipelines/demo.yaml --gpus 8
    batch-llm recommend dags/pipelines/demo.yaml --rows 1000000 --gpus 8xH200 --prompt-tokens 512

``run`` goes through fetch, quantize, plan, every shard, content filter, EvalScope and publish, and prints
where the dataset and the run report are. ``run-shard`` runs one shard of a run (planning it first when
needed); a later ``run --run-id`` with the same id reuses every committed shard. ``report`` and ``doctor``
take a ``summary.json``, a published version, a partition (``_CURRENT.json``), a run's folder under
``runs/``, a pipeline's output folder or its YAML file (its latest partition; a table pipeline's latest published
run).

Long work shows a progress bar (rows, output tokens/s, ETA) on a terminal, and plain lines otherwise.

``run`` and ``run-shard`` are quiet: the terminal shows the stages and the progress; what the engine libraries
print (vLLM's and transformers' logs, warnings, their engine-core processes' output, C-level messages) goes to
the run's log file, whose path is the first line printed (``<run folder>/logs/`` when the run folder is on this
machine). ``--verbose`` leaves it all on the terminal, as before.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import errno
import os
import re
import shlex
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

import yaml

from batch_llm.config import ConfigError, EngineNotInstalled, PipelineConfig, load_config, require_engine_installed
from batch_llm.config.capabilities import missing_package
from batch_llm.host import path_policy
from batch_llm.isolation.worker_log import engine_line
from batch_llm.manifests import PlanManifest, QuantizeManifest, RunSummary, ShardManifest, ShardResult

PROGRESS = re.compile(r"progress: (\d+)/(\d+) rows, ([\d.]+|inf|nan) output tok/s, ETA (\S+?)s\s*$")
NO_PROGRESS_BAR = "progress as plain lines: rich is not installed here; the cli extra adds the progress bar " \
                  "(pip install 'batch-llm[cli]')"


# ------------------------------------------------------------------------------------------ arguments
def _key_value(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected key=value (a dotted config key), got {text!r}")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def _date(text: str) -> str:
    try:
        return dt.date.fromisoformat(text).isoformat()
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a date YYYY-MM-DD, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="batch-llm", description="Offline batch LLM inference: the pipeline "
                                "without Airflow, its run report and its doctor.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def config_args(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("config", metavar="CONFIG.yaml", help="a pipeline YAML file")
        sp.add_argument("--set", dest="overrides", action="append", type=_key_value, default=[],
                        metavar="KEY=VALUE", help="override a config key (dotted; value parsed as YAML), repeatable")

    v = sub.add_parser("validate", help="check a pipeline file; prints OK or the error naming file and key")
    config_args(v)

    def run_args(sp: argparse.ArgumentParser) -> None:
        config_args(sp)
        sp.add_argument("--input", metavar="PATH", help="input.path instead of the file's")
        sp.add_argument("--output", metavar="PATH", help="output.path instead of the file's")
        sp.add_argument("--ds", type=_date, default=None, metavar="YYYY-MM-DD",
                        help="the run's date: {ds} in paths and the partition (default: today)")
        sp.add_argument("--run-id", default=None, help="reuse a run's committed stages and shards under this id")
        sp.add_argument("--plain", action="store_true", help="plain progress lines even on a terminal")
        sp.add_argument("-v", "--verbose", action="store_true", help="the engine libraries' own logs on the "
                        "terminal too (default: in the run's log file, whose path is printed first)")

    r = sub.add_parser("run", help="run the whole pipeline locally, end to end")
    run_args(r)
    rs = sub.add_parser("run-shard", help="run one shard of a run (plans the run first when needed)")
    run_args(rs)
    rs.add_argument("--shard", type=int, required=True, metavar="N", help="the shard index (0-based)")

    for name, text in (("report", "show a run's HTML report (written when missing) and the doctor's findings"),
                       ("doctor", "the doctor's findings for a run")):
        sp = sub.add_parser(name, help=text)
        sp.add_argument("target", metavar="PIPELINE_RUN_PARTITION_OR_SUMMARY",
                        help="a pipeline YAML or folder (its latest run), a partition, a published version, a run "
                        "folder or a summary.json")
        sp.add_argument("--gpus", type=int, default=None, help="GPUs in the pool (default: $BATCH_LLM_GPUS)")
        if name == "report":
            sp.add_argument("--regenerate", action="store_true", help="write report.html again")
    rc = sub.add_parser("recommend", help="whether the model fits GPUs, at which tensor_parallel_size, how fast, "
                        "how many GPU-hours (batch_llm/sizing/recommend.py)")
    config_args(rc)
    rc.add_argument("--rows", type=int, required=True, metavar="N", help="rows of the job")
    rc.add_argument("--gpus", default="1xH200", metavar="COUNTxNAME", help="e.g. 8xH200, 4xH100, 2xA100-40, "
                    "L40S, A10, cpu (default: 1xH200)")
    rc.add_argument("--prompt-tokens", type=float, default=None, help="mean prompt tokens (default: 512)")
    rc.add_argument("--output-tokens", type=float, default=None, help="mean output tokens "
                    "(default: sampling.max_tokens)")
    rc.add_argument("--model-config", metavar="PATH", help="the model's config.json (default: the pipeline's model "
                    "folder where it is on this machine)")
    rc.add_argument("--json", action="store_true", help="print JSON")
    from batch_llm.frontends.swift import add_infer_parser  # `batch-llm infer`: ms-swift's `swift infer` flags
    add_infer_parser(sub, COMMANDS, run=cmd_run)
    from batch_llm.frontends.run_batch import add_run_batch_parser  # `batch-llm run-batch`: vLLM's `vllm run-batch` flags
    add_run_batch_parser(sub, COMMANDS, run=cmd_run)
    return p


# ------------------------------------------------------------------------------------------ progress
class Reporter:
    """Receives the stages' messages (``say``): a rich progress bar on a terminal, plain lines otherwise.

    With a ``log`` (the run's log file, quiet mode), every message is written there too, and lines that are a
    library's log rather than a stage's message (``engine_line``: what a worker process relays) go only there."""

    def __init__(self, tty: bool | None = None, stream=None, log: TextIO | None = None):
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty() if tty is None else tty
        self.log = log
        self._progress: Any = None  # rich.progress.Progress on a terminal
        self._task: Any = None
        self._total = 0

    def __enter__(self) -> "Reporter":
        if self.tty:
            try:
                from rich.console import Console
                from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
            except ImportError:  # a base install: the same messages as plain lines
                self.say(NO_PROGRESS_BAR)
                return self
            self._progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                      TextColumn("rows"), TextColumn("{task.fields[tps]} tok/s"),
                                      TextColumn("ETA {task.fields[eta]}"), TimeElapsedColumn(),
                                      console=Console(file=self.stream), transient=False,
                                      # rich's default swaps sys.stdout/stderr for its own while the bar runs: a
                                      # library logger made meanwhile (vLLM's) then wrote over the bar, not into
                                      # the log file that descriptors 1 and 2 go to (engine_logs)
                                      redirect_stdout=False, redirect_stderr=False)
            self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def begin(self, label: str, total: int) -> None:
        self._total = total
        if self._progress is not None:
            self._task = self._progress.add_task(label, total=total, tps="–", eta="–")
        else:
            self.say(f"{label}: {total} rows")

    def end(self) -> None:
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, completed=self._total, eta="0s")
        self._task = None

    def say(self, msg: str) -> None:
        if self.log is not None:
            engine = engine_line(msg)
            self.log.write(f"{msg}\n" if engine else f"[batch-llm {time.strftime('%H:%M:%S')}] {msg}\n")
            self.log.flush()
            if engine:
                return
        m = PROGRESS.search(msg)
        if m and self._progress is not None and self._task is not None:
            done, total, tps, eta = int(m[1]), int(m[2]), m[3], m[4]
            self._progress.update(self._task, completed=done, total=total, tps=tps, eta=_eta(eta))
            return
        if self._progress is not None:
            self._progress.console.print(msg, markup=False, highlight=False)
        else:
            print(msg, file=self.stream, flush=True)

    __call__ = say


def _eta(seconds: str) -> str:
    try:
        s = float(seconds)
    except ValueError:
        return seconds
    if s != s or s == float("inf"):
        return "?"
    return f"{int(s // 60)}m{int(s % 60):02d}s" if s >= 60 else f"{s:.0f}s"


# ------------------------------------------------------------------------------------------ engine logs
def log_file_for(layout, name: str) -> Path:
    """Where a command's engine logs go: ``<run folder>/logs/<name>-<time>.log`` when the run folder is on this
    machine, else the same under the temporary folder (``batch-llm/<pipeline>/<run id>/``)."""
    from batch_llm.io.storage import is_local

    stamp = time.strftime("%Y%m%dT%H%M%S")
    run_dir = layout.run_dir.path()
    base = Path(run_dir.path) if is_local(run_dir) else \
        Path(tempfile.gettempdir()) / "batch-llm" / layout.pipeline / re.sub(r"[^A-Za-z0-9_.-]", "_", layout.run_id)
    return base / "logs" / f"{name}-{stamp}.log"


@contextmanager
def engine_logs(path: Path | None) -> Iterator[tuple[TextIO, TextIO | None]]:
    """Sends everything written to file descriptors 1 and 2 to ``path`` while the block runs, and yields (a
    stream to the terminal, the log file): vLLM's logger (on ``sys.stdout``), transformers' and Python's
    warnings (``sys.stderr``), C-level messages, and the processes the engine starts (vLLM's engine core), which
    inherit these descriptors and keep writing to the file after the block. ``path`` None: nothing is moved
    (``--verbose``); so too where stdout or stderr is no file descriptor (an embedding application's)."""
    if path is None:
        yield sys.stdout, None
        return
    try:
        fds = sys.stdout.fileno(), sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError and a ValueError
        fds = None
    if fds != (1, 2):
        yield sys.stdout, None
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    log = open(path, "a", encoding="utf-8", buffering=1)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    terminal = open(os.dup(1), "w", encoding=sys.stdout.encoding or "utf-8", errors="replace", buffering=1)
    try:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        yield terminal, log
    finally:
        for stream in (sys.stdout, sys.stderr, terminal, log):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
        terminal.close()
        log.close()


@contextmanager
def quiet_run(args: argparse.Namespace, layout, name: str) -> Iterator[Reporter]:
    """The Reporter of a ``run`` / ``run-shard``: the log file's path first, then the stages on the terminal
    and the engine libraries' output in that file (everything on the terminal with ``--verbose``)."""
    path = None if getattr(args, "verbose", False) else log_file_for(layout, name)
    with engine_logs(path) as (terminal, log):
        if log is not None:
            args.log_file = str(path)
            print(f"engine logs: {path} (--verbose: on this terminal)", file=terminal, flush=True)
            log.write(f"[batch-llm {time.strftime('%Y-%m-%d %H:%M:%S')}] {shlex.join(['batch-llm', *args.argv])}\n")
        with Reporter(tty=False if args.plain else None, stream=terminal, log=log) as rep:
            yield rep


# ------------------------------------------------------------------------------------------ commands
def config_from_args(args: argparse.Namespace) -> PipelineConfig:
    cfg = load_config(args.config)
    over: dict[str, Any] = {}
    for key in ("input", "output"):
        if getattr(args, key, None):
            over[f"{key}.path"] = _abs(getattr(args, key))
    over.update(dict(args.overrides))
    return cfg.with_overrides(over, source=f"{args.config} (command line)") if over else cfg


def _abs(path: str) -> str:
    return path if "://" in path else os.path.abspath(os.path.expanduser(path))


def cmd_validate(args: argparse.Namespace) -> int:
    import warnings

    with warnings.catch_warnings(record=True) as caught:  # what could not be checked here: said, one line each
        warnings.simplefilter("always")
        cfg = config_from_args(args)
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)
    if problem := missing_package(cfg.engine.kind, cfg.engine.python):  # the file is fine: it runs elsewhere
        print(f"warning: engine.kind {cfg.engine.kind}: {problem} (`batch-llm run` here refuses it)", file=sys.stderr)
    shards = f"num_shards {cfg.sharding.num_shards}" if cfg.sharding.num_shards else \
        f"rows_per_shard {cfg.sharding.rows_per_shard or 'default'}"
    print(f"OK: {args.config}: pipeline {cfg.name!r}, model {cfg.model.ref}, engine {cfg.engine.kind}, {shards}")
    return 0


def _layout(cfg: PipelineConfig, args: argparse.Namespace, default_run_id: str):
    from batch_llm.layout import RunLayout

    out = path_policy.resolve(cfg.output.path)
    if out.is_local and out.local_path and (problem := path_policy.local_folder_problem(out.local_path)):
        # before anything is written there (the run's log file is the first thing): one line, not a traceback
        raise ConfigError(f"output.path: {problem}; name a folder (--output or output.path)")
    inp = path_policy.resolve(cfg.input.path)
    if out.is_local and inp.is_local and out.local_path and inp.local_path and \
            os.path.realpath(out.local_path) == os.path.realpath(inp.local_path):
        raise ConfigError(f"output.path: {cfg.output.path} is the input (input.path); name another folder "
                          f"(--output or output.path)")
    try:  # a --run-id of "..": refused before anything is written, in one line
        return RunLayout.for_run(cfg, run_id=args.run_id or default_run_id, ds=args.ds)
    except ConfigError as e:
        raise ConfigError(f"--run-id: {e}" if args.run_id else str(e)) from None


def _prepare(cfg: PipelineConfig, layout, say: Callable[[str], None]) -> tuple[QuantizeManifest, PlanManifest]:
    from batch_llm import api

    say(f"run {layout.run_id}: artifacts under {layout.run_dir.url}")
    t0 = time.perf_counter()
    fetched = api.fetch(cfg, layout)
    say(f"model {fetched.id} ({'cache hit' if fetched.cache_hit else 'fetched'}, "
        f"{fetched.total_bytes / 1e6:.0f} MB) in {time.perf_counter() - t0:.1f}s")
    model = api.quantize(cfg, layout, fetched)
    if model.quantized:
        say(f"quantized: {model.local_dir}")
    plan = api.plan_shards(cfg, layout)
    say(f"plan: {plan.rows_read} rows read, {plan.valid} valid, {plan.invalid} invalid, "
        f"{len(plan.shards)} shard(s) in {plan.seconds:.1f}s")
    return model, plan


def _shard(cfg: PipelineConfig, layout, model: QuantizeManifest, shard, rep: Reporter) -> ShardManifest:
    from batch_llm import api

    rep.begin(f"shard {shard.index}", shard.rows)
    try:
        return api.infer_shard(cfg, layout, model, shard, say=rep.say)
    finally:
        rep.end()


def _shard_task(cfg: PipelineConfig, layout, model: QuantizeManifest, shards: list,
                rep: Reporter) -> list[ShardManifest]:
    """One inference task's shards (``api.shard_tasks``): one shard as ``_shard``; several in turn on one
    engine (``sharding.shards_per_task``), as the Airflow task runs them."""
    from batch_llm import api

    if len(shards) == 1:
        return [_shard(cfg, layout, model, shards[0], rep)]
    rep.begin(f"shards {shards[0].index}-{shards[-1].index}", sum(s.rows for s in shards))
    try:
        return api.infer_shards(cfg, layout, model, shards, say=rep.say)
    finally:
        rep.end()


def _review(cfg: PipelineConfig, layout, plan: PlanManifest, shards: list, rep: Reporter) -> list | None:
    """The content review's pass (``filter.review``) over every shard, on one engine; None without a review."""
    from batch_llm import api
    from batch_llm.stages.review import review_active

    if not review_active(cfg):
        return None
    model = api.review_fetch(cfg, layout)
    rep.say(f"review model {model.id} ({'cache hit' if model.cache_hit else 'fetched'})")
    rep.begin("review", sum(ShardResult.of(s).metrics.ok for s in shards))
    try:
        return list(api.review_shards(cfg, layout, model, plan, shards, say=rep.say))
    finally:
        rep.end()


def _push_metrics(pipeline: str, run_id: str, manifests: list[ShardManifest]) -> None:
    """Each committed shard's metrics to the Pushgateway of ``BATCH_LLM_PUSHGATEWAY_URL``, as the Airflow task
    pushes them (none configured: nothing; a failed push is a warning, not the run's failure)."""
    from batch_llm.analysis import metrics_push

    if metrics_push.configured_url():
        for m in manifests:
            metrics_push.push_manifest(pipeline, run_id, m)


def cmd_run(args: argparse.Namespace) -> int:
    from batch_llm import api
    from batch_llm.analysis.doctor import diagnose, format_findings
    from batch_llm.layout import read_manifest_at, shard_manifests

    cfg = config_from_args(args)
    require_engine_installed(cfg.engine.kind, cfg.engine.python)
    layout = _layout(cfg, args, f"cli__{time.strftime('%Y%m%dT%H%M%S')}")
    with quiet_run(args, layout, "run") as rep:
        model, plan = _prepare(cfg, layout, rep.say)
        shards: list[ShardResult | ShardManifest | dict] = []
        for task in api.shard_tasks(cfg, plan):
            done = _shard_task(cfg, layout, model, task, rep)
            _push_metrics(cfg.name, layout.run_id, done)
            shards += done
        reviews = _review(cfg, layout, plan, shards, rep)
        filtered = api.content_filter(cfg, layout, plan, shards, reviews)
        fs = filtered.summary
        rep.say(f"content filter: {fs.rows_scanned} rows scanned, {fs.rows_affected} affected, "
                f"{fs.rows_dropped} dropped")
        if fs.review is not None:
            rep.say(f"content review: {fs.review.rows_reviewed} rows reviewed, verdicts {fs.review.verdicts}, "
                    f"categories {fs.review.categories}, {fs.review.rows_dropped} dropped")
        scores = api.evaluate(cfg, layout, plan, filtered)
        sample = f" (a sample of {scores.num_samples} of {scores.rows_with_references} rows)" if scores.sampled else ""
        rep.say(f"evaluate: {scores.skipped or scores.metrics.get(cfg.evaluate.metric)}{sample}")
        m = api.publish(cfg, layout, plan, filtered, scores, extra_manifests={
            "fetch": read_manifest_at(layout, "fetch"), "quantize": read_manifest_at(layout, "quantize"),
            "infer": shard_manifests(layout)})
    print(f"published {m.rows} rows")
    if getattr(args, "published_paths", True):  # not where a front-end's work folder is removed at the end
        print(f"  dataset: {m.dataset}")
        print(f"  errors:  {m.errors} ({m.error_rows} rows)")
        print(f"  summary: {m.summary}")
        if m.report:
            print(f"  report:  {m.report}")
    from batch_llm.io.storage import Location

    print(format_findings(diagnose(RunSummary.read(Location(m.summary, layout.output_root.options).path()))))
    return 0


def cmd_run_shard(args: argparse.Namespace) -> int:
    from batch_llm.layout import shard_name

    cfg = config_from_args(args)
    require_engine_installed(cfg.engine.kind, cfg.engine.python)
    ds = args.ds or dt.date.today().isoformat()
    layout = _layout(cfg, args, f"cli__{ds}")
    with quiet_run(args, layout, shard_name(args.shard)) as rep:
        model, plan = _prepare(cfg, layout, rep.say)
        by_index = {s.index: s for s in plan.shards}
        m = _shard(cfg, layout, model, by_index[args.shard], rep) if args.shard in by_index else None
    if m is None:
        print(f"error: the plan of run {layout.run_id} has {len(by_index)} shard(s) "
              f"(0..{len(by_index) - 1}); no shard {args.shard}", file=sys.stderr)
        return 1
    mm = m.metrics
    print(f"shard {m.shard}: {mm.ok} ok, {mm.errors} errors, {mm.output_tokens} output tokens, "
          f"{mm.output_tokens_per_second} tok/s")
    print(f"  outputs: {m.outputs}")
    print(f"  finish the run with: {finish_command(args, layout.run_id, ds)}")
    return 0


def finish_command(args: argparse.Namespace, run_id: str, ds: str) -> str:
    """The ``run`` command that completes this shard's run: the same arguments, without ``--shard``."""
    words, skip = [], False
    for w in getattr(args, "argv", None) or []:
        if skip:
            skip = False
            continue
        if w in ("--shard", "--run-id", "--ds"):
            skip = True
            continue
        if w.startswith(("--shard=", "--run-id=", "--ds=")):
            continue
        words.append("run" if w == "run-shard" else w)
    return shlex.join(["batch-llm", *words, "--run-id", run_id, "--ds", ds])


def find_summary(target: str):
    """(RunSummary, version Location, pipeline root Location) for a summary.json, a published version, a
    partition, a run folder, a pipeline folder or a pipeline YAML file (the pipeline folder of its output.path):
    a pipeline's latest partition, or where it publishes into a table (no partition folders), its latest
    published run."""
    from batch_llm.io.storage import Location, exists, read_json, read_manifest

    loc = Location(_abs(target))
    p = loc.path()
    shown = target
    if p.suffix in (".yaml", ".yml") and p.is_file():
        cfg = load_config(loc.url)
        loc = Location(_abs(cfg.output.path)).child(cfg.name)
        p = loc.path()
        shown = f"{target} (its pipeline folder {loc.url})"
    if p.name != "summary.json":
        if exists(p / "summary.json"):
            loc = loc.child("summary.json")
        elif exists(p / "_CURRENT.json"):
            loc = Location(read_json(p / "_CURRENT.json")["version"]).child("summary.json")
        elif exists(p / "publish" / "manifest.json"):
            loc = Location(read_manifest(p / "publish")["summary"])
        elif (latest := _latest_summary(loc)) is not None:
            loc = latest
        else:
            raise FileNotFoundError(
                f"{shown}: no run summary here (give a pipeline YAML, a summary.json, a published version, a "
                f"partition with _CURRENT.json, a run folder with publish/manifest.json or a pipeline folder; a "
                f"pipeline has one once a run published)")
    if not exists(loc.path()):
        raise FileNotFoundError(f"{loc.url}: no such summary")
    summary = RunSummary.read(loc.path())
    version = Location(loc.url.rsplit("/", 1)[0], loc.options)
    return summary, version, _pipeline_root(version)


def _latest_summary(pipeline: Any) -> Any:
    """The summary of a pipeline folder's latest run: its last partition's published version (``_CURRENT.json``),
    else (a table pipeline: the rows went to the table, the summary stayed in the run's ``publish`` folder) the
    last published run of its last partition with one; None where no run published."""
    from batch_llm.io.storage import Location, exists, list_files, read_json

    p = pipeline.path()
    if not exists(p) or not p.is_dir():
        return None
    parts = sorted(d.name for d in list_files(p) if exists(d / "_CURRENT.json"))
    if parts:
        return Location(read_json(p / parts[-1] / "_CURRENT.json")["version"], pipeline.options).child("summary.json")
    for part in sorted((d.name for d in list_files(p / "runs")), reverse=True):
        published = [s for run in list_files(p / "runs" / part) if exists(s := run / "publish" / "summary.json")]
        if published:
            latest = max(published, key=lambda s: RunSummary.read(s).published_at)
            return pipeline.child("runs", part, latest.parent.parent.name, "publish", "summary.json")
    return None


def _pipeline_root(version: Any) -> Any:
    """The pipeline folder of a summary's folder: ``<pipeline>/<partition>/<version>`` (a published version) or
    ``<pipeline>/runs/<partition>/<run>/publish`` (a table pipeline's run)."""
    from batch_llm.io.storage import Location

    parts = version.url.rsplit("/", 4)
    if len(parts) == 5 and parts[1] == "runs" and parts[4] == "publish":
        return Location(parts[0], version.options)
    return Location(version.url.rsplit("/", 2)[0], version.options)


def cmd_report(args: argparse.Namespace) -> int:
    from batch_llm.analysis.doctor import diagnose, format_findings
    from batch_llm.analysis.report import REPORT_NAME, write_run_report
    from batch_llm.io.storage import exists

    summary, version, root = find_summary(args.target)
    report = version.child(REPORT_NAME)
    if args.regenerate or not exists(report.path()):
        url = write_run_report(summary, version, root, gpus=args.gpus)
        print(f"report written: {url}")
    else:
        print(f"report: {report.url}")
    print(f"summary: {version.child('summary.json').url}")
    print(format_findings(diagnose(summary, gpus=args.gpus, options=version.options)))
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from batch_llm.analysis.doctor import diagnose, format_findings

    summary, version, _ = find_summary(args.target)
    print(f"{summary.pipeline} {summary.partition} (run {summary.run_id})")
    print(format_findings(diagnose(summary, gpus=args.gpus, options=version.options)))
    return 0


def cmd_recommend(args: argparse.Namespace) -> int:
    import json

    from batch_llm.sizing import recommend as rec
    from batch_llm.sizing.inputs import find_model_config

    cfg = config_from_args(args)
    try:
        path = Path(args.model_config) if args.model_config else find_model_config(cfg)
        shape = rec.load_model_shape(path)
        shape = shape if args.model_config else dataclasses.replace(shape, name=cfg.model.ref)
        config = json.loads((path / "config.json" if path.is_dir() else path).read_text(encoding="utf-8"))
        job = rec.job_from_config(cfg, args.rows, args.prompt_tokens, args.output_tokens, model_config=config)
        result = rec.recommend(shape, rec.parse_gpus(args.gpus), job)
    except rec.DoesNotFit as e:
        print(json.dumps({"fits": False, "error": str(e), "alternatives": e.alternatives}) if args.json
              else f"error: does not fit: {e}", file=sys.stdout if args.json else sys.stderr)
        return 2
    except rec.RecommendError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.prompt_tokens is None:
        result.notes.insert(0, f"prompt tokens assumed {job.prompt_tokens:,.0f} (give --prompt-tokens)")
    if args.output_tokens is None:
        result.notes.insert(0, f"output tokens = sampling.max_tokens {job.output_tokens:,.0f}, an upper bound "
                            f"(give --output-tokens)")
    print(json.dumps({"fits": True, **result.to_dict()}, indent=1) if args.json else rec.format_recommendation(result))
    return 0


COMMANDS = {"validate": cmd_validate, "run": cmd_run, "run-shard": cmd_run_shard, "report": cmd_report,
            "doctor": cmd_doctor, "recommend": cmd_recommend}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    rc = 1
    try:
        rc = _run_command(args)
    finally:
        if rc != 0 and getattr(args, "log_file", None):  # a failed or interrupted run: where the engine said why
            print(f"engine logs: {args.log_file}", file=sys.stderr)
    if argv is None:  # the program itself (console script, python -m), not a caller's function call
        exit_without_teardown(rc)
    return rc


def exit_without_teardown(rc: int) -> None:
    """Ends a process that ran an engine in-process once its work is on disk: the exit handlers run (vLLM's
    shutdown, logging's flush), then the process exits without the interpreter's teardown of torch and vLLM's
    ~7,000 modules, which took 2-3 s of a 25 s `batch-llm infer` on a 2-core CPU and writes nothing. A process
    that never imported torch, or still has a non-daemon thread to wait for, exits the ordinary way."""
    import atexit
    import threading

    if "torch" not in sys.modules or any(t.is_alive() and not t.daemon and t is not threading.main_thread()
                                         for t in threading.enumerate()):
        return
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can reach it
            pass
    os._exit(rc)


def _run_command(args: argparse.Namespace) -> int:
    try:
        return COMMANDS[args.command](args)
    except EngineNotInstalled as e:  # nothing to run it with: a usage error, as argparse's (exit 2)
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (FileNotFoundError, NotADirectoryError) as e:  # a path to a file, or through one
        print(f"error: {e.filename + ': ' if getattr(e, 'filename', None) else ''}{e.strerror or e}",
              file=sys.stderr)
        return 1
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        print(f"error: {e.filename or 'a write'}: {e.strerror}; nothing half-written is left there: free space "
              f"on that disk (or write elsewhere: --output, output.path) and run again", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; committed chunks are kept: run again with the same --run-id to resume",
              file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - stage failures whose message says it all
        if type(e).__name__ in ("ShardFailed", "EvaluationBelowThreshold"):
            print(f"error: {e}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    raise SystemExit(main())
