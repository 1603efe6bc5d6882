"""Scores generated answers against reference answers with EvalScope, offline.

EvalScope normally runs the model itself. Here a ``ModelAPI`` replays the outputs the inference stage already
wrote, so EvalScope only loads a local ``general_qa`` dataset, scores every answer and writes its usual reports
(``<work_dir>/reports/...json``, ``report.html``, per-sample scores under ``reviews/``).

Metric names are EvalScope's own per-sample keys (``general_qa`` reports these):

* ``Rouge-1-R/P/F``, ``Rouge-2-R/P/F``, ``Rouge-L-R/P/F``: ROUGE recall, precision and F1 (``rouge_chinese``
  on whitespace tokens; text that contains Chinese is segmented with jieba first). An output equal to its
  reference scores ~1.0 (F is 0.999999995: the library adds an epsilon).
* ``bleu-1`` .. ``bleu-4``: NLTK sentence BLEU with a single n-gram order each (``bleu-4`` is the 4-gram
  precision with brevity penalty, not cumulative BLEU-4; no smoothing, so a missing order gives ~1e-308).

The report JSON names them by identity (``rouge`` + ``{variant: l, statistic: f1}``); they are mapped back to
the names above. ``metric`` is matched whatever its case and separators (``rouge-l-f``, ``rouge_l_f`` and
``mean_Rouge-L-F`` work too): ``canonical_metric`` gives EvalScope's spelling, which the config stores.
"""
from __future__ import annotations

import contextlib
import hashlib
import heapq
import io
import json
import logging
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batch_llm.config import PipelineConfig
from batch_llm.config.metric_names import canonical_metric, metric_key
from batch_llm.io.images import content_text
from batch_llm.io.storage import (
    Location,
    iter_jsonl,
    write_bytes_atomic,
)
from batch_llm.manifests import (
    EvaluateManifest,
    FilterManifest,
    PlanManifest,
)

if TYPE_CHECKING:

    pass
from batch_llm.layout import RunLayout
from batch_llm.rows.records import joined_outputs
from batch_llm.stages.filter_parts import filtered_outputs

SUBSET = "outputs"  # the dataset file is <work_dir>/dataset/outputs.jsonl
MODEL_ID = "stored_outputs"  # EvalScope's folder name for the "model" under reports/, reviews/, predictions/

# Nothing on this path needs a hub (local dataset, replayed outputs, rule-based scoring; the tests check that
# no socket is opened). Set while EvalScope runs, then restored, for code imported only then; libraries
# imported earlier (huggingface_hub, datasets) read these at import and are not affected.
_OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
_PUNKT = "tokenizers/punkt_tab/english/"
_PUNKT_FILES = ("collocations.tab", "sent_starters.txt", "abbrev_types.txt", "ortho_context.tab")

class MetricNotScored(RuntimeError):
    """``evaluate.min_score`` is set but the scores hold no value of ``evaluate.metric``: the gate cannot pass."""


def metric_score(metrics: dict[str, float], name: str) -> float | None:
    """The score of ``name`` in ``metrics`` however either is spelled (a manifest may predate the canonical
    spelling), or None."""
    key = metric_key(name)
    return next((v for k, v in metrics.items() if metric_key(k) == key), None)


def score_with_evalscope(records: list[dict], work_dir: Path, *, metric: str = "Rouge-L-F") -> dict:
    """Scores ``records`` (``id``, ``question``, ``output``, ``reference``) with EvalScope's ``general_qa``.

    Returns ``metrics`` (name -> mean over the records, from EvalScope's report, which rounds to 4 decimals),
    ``metric``/``score`` (the requested metric under its normalized name, and its value), ``num_samples``,
    ``per_sample`` (id -> {name: unrounded score}), ``metric_errors`` (metric family -> first error; its
    names are left out of ``metrics``), the report paths and ``evalscope_version``.
    Several calls per process are fine; use a fresh ``work_dir`` per call to keep each run's files.
    """
    evalscope = _import_evalscope()
    from evalscope import TaskConfig, run_task
    from evalscope.api.metric.semantics import MetricIdentity
    from evalscope.benchmarks.general_qa_vqa_metrics import METRIC_SCORE_KEYS
    from evalscope.metrics.semantics.naming import canonicalize_producer_identity

    names = [n for keys in METRIC_SCORE_KEYS.values() for n in keys]
    wanted = _normalize_metric(metric, names)
    if not records:
        raise ValueError("score_with_evalscope: no records to score")
    ids = [str(r["id"]) for r in records]
    if len(set(ids)) != len(ids):
        raise ValueError("score_with_evalscope: record ids must be unique")

    work_dir = Path(work_dir).resolve()
    for sub in ("reports", "predictions", "reviews"):
        # A report left by an earlier run must not pass for this one's, and predictions would be appended.
        shutil.rmtree(work_dir / sub / MODEL_ID, ignore_errors=True)
    data_dir = work_dir / "dataset"
    data_dir.mkdir(parents=True, exist_ok=True)
    with open(data_dir / f"{SUBSET}.jsonl", "w", encoding="utf-8") as f:
        for rid, r in zip(ids, records):
            # The "messages" form lets the user message carry the record id: the replaying model looks the
            # output up by id (two records may share a question), and each review line names its record.
            row = {"messages": [{"role": "user", "content": r["question"], "id": rid}], "answer": r["reference"]}
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    outputs = {rid: r.get("output") or "" for rid, r in zip(ids, records)}

    task = TaskConfig(
        model=_replay_model(outputs),
        model_id=MODEL_ID,
        eval_type="custom",
        datasets=["general_qa"],
        dataset_args={"general_qa": {"local_path": str(data_dir), "subset_list": [SUBSET]}},
        dataset_dir=str(data_dir),
        judge={"strategy": "rule"},  # the default may pick a hosted judge model, which needs the network
        work_dir=str(work_dir),
        no_timestamp=True,
        seed=None,  # a seed makes EvalScope reseed random/numpy/torch for the whole process
    )
    with (
        _restore_env_and_root_logging(),
        tempfile.TemporaryDirectory(prefix="batch_llm_evalscope_") as tmp,
        _sandbox(Path(tmp)),
        warnings.catch_warnings(),
    ):
        # The task log is for the pipeline: NLTK warns, in 4 lines per row, that a short output with no 4-gram in
        # common scores BLEU 0 (the score says so); EvalScope logs its whole config and tables at INFO (its
        # warnings stay: its logger's handler holds the stream it was made with at import) and draws progress
        # bars on sys.stderr, dropped here; the evaluate task logs the scores, and a failure raises
        warnings.filterwarnings("ignore", category=UserWarning, module=r"nltk\.translate")
        evalscope_log = logging.getLogger("evalscope")
        evalscope_log.addFilter(_warnings_only)
        try:
            with contextlib.redirect_stderr(io.StringIO()):
                run_task(task)
        finally:
            evalscope_log.removeFilter(_warnings_only)
            _close_log_file(work_dir)

    report_json = work_dir / "reports" / MODEL_ID / "general_qa.json"
    if not report_json.is_file():
        raise RuntimeError(f"EvalScope wrote no report at {report_json}; see {work_dir / 'logs'}")
    report = json.loads(report_json.read_text(encoding="utf-8"))
    by_identity = {canonicalize_producer_identity(n, "mean"): n for n in names}
    metrics, num = {}, {}
    for m in report["metrics"]:
        identity = MetricIdentity(**m["identity"])
        name = by_identity.get(identity, identity.key)
        metrics[name], num[name] = float(m["score"]), int(m["num"])

    reviews_dir = work_dir / "reviews" / MODEL_ID
    per_sample: dict[str, dict[str, float]] = {}
    errors: dict[str, Any] = {}  # metric family -> EvalScope's error, as its review records it
    for path in sorted(reviews_dir.glob(f"general_qa_{SUBSET}*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            review = json.loads(line)
            user = next(msg for msg in review["messages"] if msg["role"] == "user")
            score = review["sample_score"]["score"]
            per_sample[user["id"]] = {k: float(v) for k, v in score["value"].items()}
            for family, err in ((score.get("metadata") or {}).get("metric_errors") or {}).items():
                errors.setdefault(family, err)
    # EvalScope logs a metric that failed and scores it 0.0; a 0 that means "could not compute" is dropped.
    failed = {n for family in errors for n in METRIC_SCORE_KEYS.get(family, ())}
    metrics = {k: v for k, v in metrics.items() if k not in failed}
    per_sample = {rid: {k: v for k, v in s.items() if k not in failed} for rid, s in per_sample.items()}
    if wanted not in metrics:
        raise RuntimeError(f"EvalScope reported no {wanted!r} (errors: {errors or 'none'}); got {sorted(metrics)}")

    html = work_dir / "reports" / "report.html"
    return {
        "metrics": metrics,
        "metric": wanted,
        "score": metrics[wanted],
        "num_samples": num[wanted],
        "per_sample": per_sample,
        "metric_errors": errors,
        "report_json": str(report_json),
        "report_html": str(html) if html.is_file() else None,
        "reviews_dir": str(reviews_dir) if reviews_dir.is_dir() else None,
        "evalscope_version": evalscope.__version__,
    }


def _normalize_metric(metric: str, names: list[str]) -> str:
    return canonical_metric(metric, names)  # against the names of the EvalScope that runs


def _replay_model(outputs: dict[str, str]):
    from evalscope.api.model import ModelAPI, ModelOutput

    class ReplayModel(ModelAPI):
        """Answers each query with the output already generated for its record."""

        def generate(self, input, tools, tool_choice, config):
            rid = next(m.id for m in reversed(input) if m.role == "user")
            return ModelOutput.from_content(model=self.model_name, content=outputs[rid])

    return ReplayModel(model_name=MODEL_ID)


def _import_evalscope():
    # Importing evalscope sets MODELSCOPE_LOG_LEVEL and runs logging.basicConfig(force=True), which would
    # replace the root handlers of the host process (an Airflow task's log handlers): undo both.
    with _restore_env_and_root_logging():
        import evalscope
        import evalscope.run  # noqa: F401  (the import that configures logging)
    return evalscope


@contextlib.contextmanager
def _restore_env_and_root_logging() -> Iterator[None]:
    env = dict(os.environ)
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        yield
    finally:
        for k in os.environ.keys() - env.keys():
            del os.environ[k]
        for k, v in env.items():
            if os.environ.get(k) != v:
                os.environ[k] = v
        root.handlers[:] = handlers
        root.setLevel(level)


@contextlib.contextmanager
def _sandbox(tmp: Path) -> Iterator[None]:
    """Offline env vars, jieba's cache and NLTK data inside ``tmp``, for the duration of one run.

    TMPDIR and NLTK_DATA are not set: ``tempfile`` and ``nltk`` read them once per process, so they would
    either be ignored or stay pointed at ``tmp`` after it is deleted. jieba and NLTK are pointed at ``tmp``
    directly instead, and restored.
    """
    os.environ.update(_OFFLINE_ENV)  # _restore_env_and_root_logging, around this, undoes it
    os.environ["MODELSCOPE_CACHE"] = str(tmp / "modelscope")  # should stay unused; else a cache lands here, not in ~

    import jieba  # Chinese segmentation: writes jieba.cache into the system temp folder on first use
    import nltk

    saved_jieba = jieba.dt.tmp_dir
    jieba.dt.tmp_dir = str(tmp)
    # English BLEU tokenizes with nltk.word_tokenize, which needs the Punkt model "punkt_tab". Where it is not
    # installed (and it cannot be downloaded here), EvalScope would log the error and score BLEU 0.
    # Punkt with empty parameters (no learned abbreviations) splits sentences at every ". "; the word
    # tokens differ only around abbreviations ("Dr." -> "Dr" "."), the same way in output and reference.
    added = None
    try:
        nltk.data.find(_PUNKT)
    except LookupError:
        added = str(tmp / "nltk_data")
        (tmp / "nltk_data" / _PUNKT).mkdir(parents=True)
        for name in _PUNKT_FILES:
            (tmp / "nltk_data" / _PUNKT / name).touch()
        nltk.data.path.append(added)
    try:
        yield
    finally:
        jieba.dt.tmp_dir = saved_jieba
        if added:
            nltk.data.path.remove(added)
            memo = getattr(nltk.tokenize, "_get_punkt_tokenizer", None)  # holds the tokenizer made from ``added``
            if memo is not None:
                memo.cache_clear()


def _warnings_only(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.WARNING


def _close_log_file(work_dir: Path) -> None:
    # run_task leaves a FileHandler on <work_dir>/logs/eval_log.log open on the "evalscope" logger.
    log = logging.getLogger("evalscope")
    for h in [h for h in log.handlers if isinstance(h, logging.FileHandler)]:
        if Path(h.baseFilename).is_relative_to(work_dir):
            log.removeHandler(h)
            h.close()


@dataclass
class ScoringSample:
    """The rows EvalScope scores: ``records`` (id, question, output, reference), drawn from ``population``
    rows that have both an output and a reference."""

    records: list[dict]
    population: int


def _rank(seed: int, rid: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{seed}\x00{rid}".encode(), digest_size=8).digest(), "big")


def sample_for_scoring(*, records: Iterable[dict], outputs: Iterable[dict], shards: Iterable[Iterable[dict]],
                       size: int | None, seed: int) -> ScoringSample:
    """A deterministic sample of ``size`` rows (all of them when None): the rows whose seeded hash of the id
    ranks lowest, so the same seed picks the same rows whatever the order or the sharding, and a larger
    size picks a superset. Streams the records, the outputs (both in input order) and the shard files (for
    the question text); holds only the sample."""

    heap: list[tuple[int, int, dict]] = []   # (-rank, idx, row): the kept rows, largest rank on top
    population = 0
    for rec, out in joined_outputs(iter(records), iter(outputs)):
        if not rec.get("reference"):
            continue
        population += 1
        item = (-_rank(seed, rec["id"]), rec["idx"],
                {"id": rec["id"], "output": out.get("output"), "reference": rec["reference"]})
        if size is None or len(heap) < size:
            heapq.heappush(heap, item)
        elif item[0] > heap[0][0]:
            heapq.heapreplace(heap, item)
    chosen = {row["id"]: row for _, _, row in heap}
    for rows in shards:
        for r in rows:
            if r["id"] in chosen:
                msgs = r.get("messages") or []
                chosen[r["id"]]["question"] = next((content_text(m["content"]) for m in reversed(msgs)
                                                    if m["role"] == "user"), "")
    picked = [row for _, _, row in sorted(heap, key=lambda t: t[1])]  # input order
    for row in picked:
        row.setdefault("question", "")
    return ScoringSample(records=picked, population=population)


class EvaluationBelowThreshold(RuntimeError):
    """EvalScope's score is below ``evaluate.min_score``."""


def evaluate(cfg: PipelineConfig, layout: RunLayout, plan: PlanManifest, filtered: FilterManifest) -> EvaluateManifest:
    """Scores outputs against reference answers with EvalScope (a deterministic sample of
    ``evaluate.sample_rows`` rows); stores its report next to the run."""
    out_dir = layout.stage("evaluate")
    m = EvaluateManifest.read_if_done(out_dir.path())
    if m is None or m.filter_generation != filtered.generation:  # scored on another pass of the filter
        m = _evaluate(cfg, layout, plan, filtered, out_dir)
    ev = cfg.evaluate
    if not ev.enabled or ev.min_score is None or m.skipped:  # a skipped evaluation names why in its manifest
        return m

    score = metric_score(m.metrics, ev.metric)
    if score is None:  # the gate fails closed: a metric it cannot find is not a pass
        raise MetricNotScored(
            f"evaluate.min_score = {ev.min_score} applies to {ev.metric}, which the scores do not hold "
            f"(found: {', '.join(sorted(m.metrics)) or 'none'}; report: {m.report_json})")
    if score < ev.min_score:
        of = f" of {m.rows_with_references} rows with references" if m.sampled else ""
        raise EvaluationBelowThreshold(
            f"{ev.metric} = {score:.4f} is below evaluate.min_score = {ev.min_score} "
            f"({m.num_samples} samples{of}; report: {m.report_json})")
    return m


def _evaluate(cfg: PipelineConfig, layout: RunLayout, plan: PlanManifest, filtered: FilterManifest,
              out_dir: Location) -> EvaluateManifest:
    opts = layout.output_root.options
    if cfg.engine.task != "generate":  # vectors, classes: no text to score against references
        m = EvaluateManifest(skipped=f"task {cfg.engine.task}")
    elif not cfg.evaluate.enabled:
        m = EvaluateManifest(skipped="evaluate.enabled is false")
    elif not plan.has_references:
        m = EvaluateManifest(skipped=f"no reference answers (column {cfg.input.reference_column!r})")
    else:

        sample = sample_for_scoring(
            records=plan.iter_records(opts),
            outputs=filtered_outputs(filtered, opts),
            shards=(iter_jsonl(Location(s.url, opts).path()) for s in plan.shards),
            size=cfg.evaluate.sample_rows, seed=cfg.evaluate.sample_seed)
        with tempfile.TemporaryDirectory(prefix="batch_llm_eval_") as tmp:
            t0 = time.perf_counter()
            res = score_with_evalscope(sample.records, Path(tmp), metric=cfg.evaluate.metric)
            seconds = time.perf_counter() - t0
            report_dir = out_dir.child("evalscope")
            uploaded = {}
            for key in ("report_json", "report_html"):
                if res.get(key):
                    src = Path(res[key])
                    # Not mkdir + write_bytes: on S3, mkdir(parents=True) creates a missing bucket.
                    write_bytes_atomic(report_dir.child(src.name).path(), src.read_bytes())
                    uploaded[key] = report_dir.child(src.name).url
        m = EvaluateManifest(metrics=res["metrics"], num_samples=res["num_samples"],
                             rows_with_references=sample.population, sample_seed=cfg.evaluate.sample_seed,
                             evalscope_version=res.get("evalscope_version"), seconds=round(seconds, 2),
                             report_json=uploaded.get("report_json"), report_html=uploaded.get("report_html"))
    m.filter_generation = filtered.generation
    m.write(out_dir.path())
    return m
