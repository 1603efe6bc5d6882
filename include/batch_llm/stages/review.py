"""Content review by a model (``filter.review``): a guard or classifier model reads each (prompt, output) and
gives a verdict, in a second inference pass run by the shard runner itself (``stages.infer``).

How, per shard (the ``review`` task, mapped over the shards like ``batch_inference``)::

    shard outputs.jsonl + the shard's prompts ─> review requests (the review template filled per row and sample)
        <run>/review/requests/shard-NNNNN-<key>.jsonl     key: the outputs file's fingerprint + the prompting
    requests ─> infer.infer_shard(review config, stage="review") ─> <run>/review/shard-NNNNN/ (chunks, manifest)

The review pass is a shard of its own: the same lease, worker, chunk commits, exactly-once resume, per-row errors
and result cache as the shards (its cache namespace is the review model's, engine's and verdict schema's; a row's
key is its review prompt, so the prompt and the output). The review config (``review_pipeline_config``) is the
pipeline's with the review's model and engine, and for ``engine.task: generate`` sampling that decodes the
verdict under ``verdict_schema``; for ``classify`` the classifier's top class, mapped by ``labels``.

The content filter then joins the verdicts to the rows (``ReviewedRows``, streamed in input order): each row gets
``review_verdict`` (``safe``, ``unsafe`` or ``error``) and ``review_categories``, and ``action`` / ``actions``
flag it, mask its output or drop it (to the errors: ``dropped by review: <category>``), counted in the filter's
summary (``summary.review``).

Why its own task after the shards rather than the shard's worker swapping engines after generation: the two
passes keep apart what fails apart (a review model that cannot load fails the review task, not the generation,
whose committed shards stand), each resumes on its own, the review can run on other GPUs (its own pool slots),
and a Clear of the review redoes only the review. The cost is a second engine start per review task, which a
swap in the same worker would pay too (one GPU holds one engine at a time); the worker's own start (~imports) and
a second lease wait are the difference. Not measured on GPUs.
"""
from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable, Iterator

from batch_llm import generated_text
from batch_llm.config import PipelineConfig, ReviewConfig, parse_config
from batch_llm.config.filter import REVIEW_PLACEHOLDERS
from batch_llm.io.storage import Location, atomic_writer, exists, iter_jsonl, json_bytes
from batch_llm.layout import RunLayout
from batch_llm.manifests import (
    FetchManifest,
    ModelRef,
    PlanManifest,
    ReviewSummary,
    ShardManifest,
    ShardResult,
    ShardSpec,
)

# A row's samples (sampling.n, at most 128) each get a review request: request idx = row idx * SAMPLE_SLOTS + sample
SAMPLE_SLOTS = 128
VERDICTS = ("safe", "unsafe")
# the strongest action of a verdict's categories wins
_STRENGTH = {"flag": 0, "mask": 1, "drop": 2}

DEFAULT_TEMPLATE = (
    "You review what an AI assistant wrote for harmful or unsafe content.\n"
    "Categories: {categories}.\n\n"
    "[User]\n{prompt}\n\n"
    "{reasoning_part}"
    "[Assistant]\n{output}\n\n"
    'Is the assistant\'s reply safe? Answer in JSON: {"verdict": "safe" or "unsafe", "categories": [the '
    "categories that apply, none when safe]}."
)


# filter.review.images: agreement: what a row with images is asked (its images go before this text)
AGREEMENT_TEMPLATE = (
    "You check whether what an AI assistant wrote agrees with the image it was shown.\n\n"
    "[User]\n{prompt}\n\n"
    "{reasoning_part}"
    "[Assistant]\n{output}\n\n"
    'Does the reply agree with the image? Answer in JSON: {"verdict": "safe" if it agrees, "unsafe" if it does not, '
    '"categories": ["{categories}"] when it does not, [] when it does}.'
)


def review_active(cfg: PipelineConfig) -> bool:
    """Whether this run reviews its outputs with a model."""
    r = cfg.filter.review
    return bool(cfg.filter.enabled and r is not None and r.enabled and cfg.engine.task == "generate")


def _review(cfg: PipelineConfig) -> ReviewConfig:
    r = cfg.filter.review
    if r is None:
        raise ValueError(f"pipeline {cfg.name!r} has no filter.review")
    return r


def verdict_schema(categories: list[str]) -> dict:
    """The JSON Schema a generate-style review model's answer is decoded under and checked against."""
    return {"type": "object", "additionalProperties": False, "required": ["verdict", "categories"],
            "properties": {"verdict": {"type": "string", "enum": list(VERDICTS)},
                           "categories": {"type": "array", "maxItems": len(categories),
                                          "items": {"type": "string", "enum": list(categories)}}}}


def review_pipeline_config(cfg: PipelineConfig) -> PipelineConfig:
    """The configuration the review pass runs with: the pipeline's, with the review's model and engine, sampling
    for the verdict, and nothing of the pipeline's own generation (its sampling columns, quantization, filter)."""
    r = _review(cfg)
    data = cfg.model_dump(mode="json")
    data["model"] = r.model.model_dump(mode="json")
    data["engine"] = r.engine.model_dump(mode="json")
    data["quantize"] = {"enabled": False}
    data["input"]["sampling_columns"] = []
    data["filter"] = {"enabled": False, "lists": []}
    data["evaluate"] = {"enabled": False}
    # the review's requests are not planned by plan.py: lengths recorded for its model would be read by no plan
    data["sharding"]["length_history"] = False
    if r.engine.task == "generate":
        data["sampling"] = {"max_tokens": r.max_tokens, "temperature": 0.0, "seed": 0,
                            "output_schema": verdict_schema(r.verdict_categories), "guided_decoding": r.guided_decoding}
    else:
        data["sampling"] = {}
    return parse_config(data, f"pipeline {cfg.name!r}: filter.review")


def review_fetch(cfg: PipelineConfig, layout: RunLayout, *, storage_options: dict | None = None) -> FetchManifest:
    """The review model, fetched as the model is (``stages.fetch``: ModelScope cache, local folder, object
    storage); its manifest in ``<run>/review/model/``."""
    import time

    from batch_llm.stages.fetch import fetch_model

    t0 = time.perf_counter()
    m = fetch_model(_review(cfg).model, storage_options=storage_options)
    m.seconds = round(time.perf_counter() - t0, 2)
    m.write(layout.review_model.path())
    return m


# ------------------------------------------------------------------------------------------ requests
def _text_and_parts(content) -> tuple[str, list]:
    """A message content's text and its parts that are not text (images: kept for a vision-language reviewer)."""
    if isinstance(content, str):
        return content, []
    if isinstance(content, list):
        texts, other = [], []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                texts.append(str(part.get("text") or ""))
            elif isinstance(part, str):
                texts.append(part)
            else:
                other.append(part)
        return "\n".join(texts), other
    return ("" if content is None else str(content)), []


def prompt_of(row: dict) -> tuple[str, list]:
    """What the user asked, as the reviewer reads it: a completion prompt's text, a chat's turns but the system
    prompt (one turn: its text; several: each as ``Role: text``), and the prompt's parts that are not text.
    A pre-tokenized row (prompt_token_ids only) shows no prompt."""
    if isinstance(row.get("text"), str):
        return row["text"], []
    turns = [m for m in row.get("messages") or [] if isinstance(m, dict) and m.get("role") != "system"]
    texts, parts = [], []
    for m in turns:
        text, other = _text_and_parts(m.get("content"))
        parts += other
        texts.append(text if len(turns) == 1 else f"{str(m.get('role') or 'user').capitalize()}: {text}")
    return "\n\n".join(texts), parts


def review_template(r: ReviewConfig) -> str:
    if r.template is not None:
        return r.template
    if r.engine.task == "classify":
        return "{output}"
    return DEFAULT_TEMPLATE.replace("{reasoning_part}", _reasoning_part(r))


def image_template(r: ReviewConfig) -> str:
    """The prompt of a row with images under ``images: agreement``."""
    if r.image_template is not None:
        return r.image_template
    return AGREEMENT_TEMPLATE.replace("{reasoning_part}", _reasoning_part(r))


def _reasoning_part(r: ReviewConfig) -> str:
    """The default templates' section showing the reasoning, where the review reads it."""
    return "[Assistant's reasoning]\n{reasoning}\n\n" if r.reasoning else ""


def fill(template: str, values: dict[str, str]) -> str:
    """The template with its placeholders filled; any other braces (a JSON example) stay as written."""
    return re.sub(r"\{(" + "|".join(REVIEW_PLACEHOLDERS) + r")\}", lambda m: values[m.group(1)], template)


def _request(r: ReviewConfig, rid: str, idx: int, text: str, parts: list, images: list | None = None) -> dict:
    """One review request: plain text, or a chat whose user turn carries the row's images (``parts``, their
    checked references ``images``: the review pass loads them as the shards do) before the review prompt."""
    if not (r.chat if r.chat is not None else r.engine.task == "generate"):
        return {"id": rid, "idx": idx, "text": text}
    content: str | list = [*parts, {"type": "text", "text": text}] if parts else text
    messages = [{"role": "system", "content": r.system_prompt}] if r.system_prompt else []
    request = {"id": rid, "idx": idx, "messages": [*messages, {"role": "user", "content": content}]}
    if parts and images:
        request["images"] = images
    return request


def request_id(row_id: str, sample: int) -> str:
    """A review request's id: the row's id and the sample as one JSON array, so that no two (row, sample) pairs
    share an id whatever the input's ids hold (joined as text, sample 1 of row ``x`` was ``x#sample1``, the id of
    sample 0 of a row named so). The verdicts join the rows by idx, not by this id."""
    return json.dumps([row_id, sample], ensure_ascii=False)


def request_key(cfg: PipelineConfig, shard: ShardResult, options: dict | None = None, *,
                joined_ids: bool = False) -> str:
    """What a shard's review requests are made from: its outputs file (as stored: size and change markers) and
    the review's prompting. Keys the requests file and the review shard's plan part, so a shard generated again, or
    a changed template, starts its review over; the content filter checks the reviews it joins by it.
    ``joined_ids``: the key of requests whose ids were the row id joined to ``#sample<k>`` (``request_id`` since):
    those files are not reused (two of their requests could share an id), and reviews finished under them still
    join (their verdicts join by idx)."""
    from batch_llm.io.identity import file_fingerprint, stable_hash

    r = _review(cfg)
    prompting: dict[str, object] = {"template": review_template(r), "system_prompt": r.system_prompt, "chat": r.chat,
                 "reasoning": r.reasoning, "categories": r.categories if r.engine.task == "generate" else None,
                 "task": r.engine.task}
    if r.images != "text":  # keys made before images were reviewed stay the same
        prompting["images"] = {"mode": r.images, "template": image_template(r), "category": r.image_category}
    if not joined_ids:
        prompting["ids"] = "request_id"
    return stable_hash({"outputs": file_fingerprint(Location(shard.outputs, options or {}).path()),
                        "prompting": prompting})[:16]


def prepare_review(cfg: PipelineConfig, layout: RunLayout, plan: PlanManifest,
                   shard: ShardResult | ShardManifest | dict) -> ShardSpec:
    """The review shard of a generated shard: its requests file, written once per ``request_key`` (a retry finds
    it and the review resumes from its committed chunks). Every usable row's every sample is one request, in the
    shard's own order; the outputs are held in memory while the shard's prompts stream past (outputs are bounded
    by max_tokens, prompts are not)."""
    r = _review(cfg)
    result = ShardResult.of(shard)
    opts = layout.output_root.options
    key = request_key(cfg, result, opts)
    loc = layout.review_requests(result.shard, key)
    path = loc.path()
    if not exists(path):
        spec = next((s for s in plan.shards if s.index == result.shard), None)
        if spec is None:
            raise ValueError(f"shard {result.shard} is not a shard of the run's plan ({len(plan.shards)} shards)")
        outputs = {o["id"]: o for o in iter_jsonl(Location(result.outputs, opts).path())}
        template = review_template(r)
        categories = ", ".join(r.categories if r.engine.task == "generate" else
                               [k for k, v in r.labels.items() if v == "unsafe"])
        # a row with images, under images: agreement, is asked whether the output agrees with them
        with_images = (image_template(r), r.image_category) if r.images == "agreement" else (template, categories)
        with atomic_writer(path) as w:
            for row in iter_jsonl(Location(spec.url, opts).path()):
                out = outputs.pop(row["id"], None)
                if out is None:  # an error row: nothing to review
                    continue
                prompt, parts = prompt_of(row)
                images = row.get("images") if parts and r.images != "text" else None
                shown, asked, cats = ([], template, categories) if images is None else (parts, *with_images)
                for k in range(generated_text.sample_count(out)):
                    filled = fill(asked, {"prompt": prompt, "output": generated_text.text_of(out, "output", k),
                                          "reasoning": generated_text.text_of(out, "reasoning", k),
                                          "categories": cats})
                    rid = request_id(row["id"], k)
                    w.write(json_bytes(_request(r, rid, row["idx"] * SAMPLE_SLOTS + k, filled, shown, images))
                            + b"\n")
    n = sum(1 for _ in iter_jsonl(path))
    return ShardSpec(index=result.shard, rows=n, url=loc.url, plan_key=key)


def review_shards(cfg: PipelineConfig, layout: RunLayout, model: ModelRef | FetchManifest | dict, plan: PlanManifest,
                  shards: list, say: Callable[[str], None] = print) -> list[ShardManifest]:
    """Reviews the given shards in this process, in turn on one engine (the CLI; the Airflow task runs the same
    shards in an isolated worker: ``isolation.shard_process`` with ``stage="review"``)."""
    from batch_llm.stages.infer.tasks import infer_shards

    specs: list[ShardSpec | dict] = [prepare_review(cfg, layout, plan, s) for s in flat_results(shards)]
    return infer_shards(review_pipeline_config(cfg), layout, model, specs, say=say, stage="review")


def flat_results(shards) -> list[ShardResult]:
    """Shard results as XCom hands them over: one per shard, or one list per task of several shards."""
    return [ShardResult.of(s) for t in shards for s in (t if isinstance(t, (list, tuple)) else [t])]


# ------------------------------------------------------------------------------------------ verdicts
def verdict_of(r: ReviewConfig, row: dict) -> tuple[str, list[str], str | None]:
    """(verdict, categories, why the review failed) of one review result row."""
    if row.get("error"):
        return "error", [], str(row["error"])
    if r.engine.task == "classify":
        label = row.get("label")
        verdict = r.labels.get(label) if isinstance(label, str) else None
        if verdict is None or not isinstance(label, str):
            return "error", [], f"the review model's class {label!r} is not in filter.review.labels"
        return verdict, [label] if verdict == "unsafe" else [], None
    try:
        value = json.loads(row.get("output") or "")
    except (json.JSONDecodeError, TypeError):
        return "error", [], f"the review model's answer is not JSON: {str(row.get('output'))[:80]!r}"
    if not isinstance(value, dict) or value.get("verdict") not in VERDICTS:
        return "error", [], f"the review model's answer has no verdict: {str(row.get('output'))[:80]!r}"
    cats = value.get("categories") or []
    cats = [c for c in cats if isinstance(c, str)] if isinstance(cats, list) else []
    return value["verdict"], cats if value["verdict"] == "unsafe" else [], None


class ReviewedRows:
    """The verdicts joined to the rows, in input order: ``take(row)`` returns the row with its verdict and the
    action applied (None: dropped) and the reason a dropped row goes to the errors with. ``verdicts``: the review
    pass's result rows (outputs and errors), sorted by their idx."""

    def __init__(self, r: ReviewConfig, verdicts: Iterator[dict], mask_char: str = "*", model: str = ""):
        self.r, self.verdicts, self.mask_char, self.model = r, verdicts, mask_char, model
        self._next: dict | None = None
        self.verdict_counts: Counter = Counter()
        self.category_counts: Counter = Counter()
        self.actions: Counter = Counter()

    def _verdicts_of(self, idx: int) -> list[dict]:
        found: list[dict] = []
        while True:
            if self._next is None:
                self._next = next(self.verdicts, None)
                if self._next is None:
                    return found
            row_idx = self._next["idx"] // SAMPLE_SLOTS
            if row_idx > idx:
                return found
            if row_idx == idx:
                found.append(self._next)
            self._next = None  # a verdict of a row the word lists dropped: passed over

    def take(self, row: dict) -> tuple[dict | None, str | None]:
        got = sorted(self._verdicts_of(row["idx"]), key=lambda v: v["idx"])
        samples = [verdict_of(self.r, v) for v in got] or [("error", [], "no review verdict for this row")]
        errors = [why for verdict, _, why in samples if verdict == "error"]
        cats = list(dict.fromkeys(c for _, cs, _ in samples for c in cs))
        verdict = "error" if errors else "unsafe" if any(v == "unsafe" for v, _, _ in samples) else "safe"
        out = {**row, "review_verdict": verdict, "review_categories": cats}
        self.verdict_counts[verdict] += 1
        self.category_counts.update(cats)
        if verdict == "error":
            out["review_error"] = errors[0]
            if self.r.on_error == "drop":
                self.actions["dropped"] += 1
                return None, f"review failed: {errors[0]}"
            self.actions["flagged"] += 1
            return out, None
        if verdict == "safe":
            return out, None
        # an unsafe verdict without a category takes the default action
        action = max([self.r.actions.get(c, self.r.action) for c in cats] or [self.r.action], key=_STRENGTH.__getitem__)
        if action == "drop":
            self.actions["dropped"] += 1
            return None, f"dropped by review: {', '.join(cats) or 'unsafe'}"
        if action == "mask":
            self.actions["masked"] += 1
            unsafe = {v["idx"] % SAMPLE_SLOTS for v, (verdict_k, _, _) in zip(got, samples) if verdict_k == "unsafe"}
            # every copy of an unsafe sample: its answer, its thinking, its tokens and their alternatives
            out = generated_text.masked(out, generated_text.whole(out, unsafe), self.mask_char)
        else:
            self.actions["flagged"] += 1
        return out, None


    def summary(self, reviews: list[ShardResult]) -> ReviewSummary:
        m = [s.metrics for s in reviews]
        return ReviewSummary(
            model=self.model, task=self.r.engine.task, rows_reviewed=sum(self.verdict_counts.values()),
            verdicts=dict(self.verdict_counts), categories=dict(self.category_counts),
            rows_flagged=self.actions["flagged"], rows_masked=self.actions["masked"],
            rows_dropped=self.actions["dropped"], requests=sum(x.rows for x in m),
            cached_requests=sum(x.cached_rows for x in m), input_tokens=sum(x.input_tokens for x in m),
            output_tokens=sum(x.output_tokens for x in m), shards=[s.shard for s in reviews])


def review_verdict_rows(reviews: list[ShardResult], options: dict) -> Iterator[dict]:
    """Every review result row (verdicts and review errors) of the run, in input order."""
    import heapq

    streams = [iter_jsonl(Location(getattr(s, key), options).path()) for s in reviews for key in ("outputs", "errors")]
    return heapq.merge(*streams, key=lambda v: v["idx"])


def check_reviews(cfg: PipelineConfig, shards: list[ShardResult], reviews: list[ShardResult], options: dict) -> None:
    """Every shard reviewed, from the outputs it has now, with the review's prompting of now."""
    got = {r.shard: r for r in reviews}
    missing = [s.shard for s in shards if s.shard not in got]
    stale = [s.shard for s in shards if s.shard in got and got[s.shard].plan_key not in
             (request_key(cfg, s, options), request_key(cfg, s, options, joined_ids=True))]
    if missing or stale:
        raise ValueError(f"filter.review: the reviews handed over do not match the shards: not reviewed "
                         f"{missing or 'none'}, reviewed from other outputs or another review prompt "
                         f"{stale or 'none'}; clear the review task with its downstream tasks")
