"""Rows with images on the real CPU vLLM engine, with the tiny random-weight BLIP-2 of ``batch_llm.tiny_models`` (its
captions and verdicts are meaningless; what is checked is where every row and every image goes).

``tests/data/image_review_pipeline.yaml`` (an image-text agreement review by the same model) over the bad-image corpus
``tests/data/images/rows.jsonl`` (plus a 50 MB image written here): through ``batch-llm run`` on local files (two
engine starts: the captions, the review), then through Airflow's ``dag.test()`` in two shards with the corpus in a
real S3 server read through Airflow connection ``lake``, on the first run's result cache (the captions, and the
reviews that got a verdict, served from it, keyed by the images' content, not their URLs; the shard holding the JPEG
that only decoding finds broken starts its engine and fails that row again). Both times: every good row published
once, every bad row in the errors once with its reason, the review's verdicts counted and applied. The captions
and the review again on the transformers engine: the same accounting, the same prompts.
Unit-level checks of the same path: tests/unit/test_image_inputs.py.
"""
from __future__ import annotations

import datetime as dt
import json
import shutil
import sys
from pathlib import Path

import pytest
from batch_llm import tiny_models
from batch_llm.config import load_config
from batch_llm.io.storage import Location, iter_jsonl, read_json
from helpers import ROOT, run_in_group


def _row_of(request_id: str) -> str:
    """The row a review request is for: review requests carry ``[row id, sample]`` as JSON (review.request_id)."""
    row_id, _sample = json.loads(request_id)
    return row_id


PIPELINE = ROOT / "tests" / "data" / "image_review_pipeline.yaml"
CORPUS = ROOT / "tests" / "data" / "images"
DS = "2026-12-05"
GOOD = {"good-red", "good-blue", "good-green", "good-red-inline", "good-text"}
BAD = {  # id -> what its error says
    "bad-truncated-png": "image 1 (truncated.png): a truncated PNG: it does not end with the IEND chunk",
    "bad-cut-jpeg": "does not decode (JPEG): image file is truncated",
    "bad-wrong-extension": "wrong extension: its name says PNG (.png) but its bytes are a JPEG image",
    "bad-empty": "image 1 (empty.png): empty (0 bytes)",
    "bad-svg": "image 1 (drawing.svg): an SVG drawing (vector graphics)",
    "bad-50mb": "image 1 (huge.png): 50.0 MiB, over input.max_image_bytes (20.0 MiB)",
    "bad-missing": "image 1 (not-there.png): no such file",
    "bad-two-images": "the row has 2 images; engine.limit_mm_per_prompt allows 1 per prompt",
    "bad-outside": "is outside the folders images may be read from",
}


def _published(out: Path, name: str) -> tuple[dict, dict[str, dict], dict[str, str]]:
    current = read_json(Location(str(out)).child(name, f"dt={DS}", "_CURRENT.json").path())
    summary = read_json(Location(current["version"]).child("summary.json").path())
    rows = {r["id"]: r for r in iter_jsonl(Location(summary["dataset"]).path())}
    errors: dict[str, str] = {}
    for e in iter_jsonl(Location(summary["errors"]).path()):
        assert e["id"] not in errors, f"{e['id']} is in the errors twice"
        errors[e["id"]] = e["reason"]
    return summary, rows, errors


# The same rows read from object storage: a missing image is a missing object, and a relative path may not climb out
# of the input's folder there either
IN_STORAGE = {**BAD, "bad-missing": "image 1 (not-there.png): no such object s3://",
              "bad-outside": "image 1 (../../../include/batch_llm/data/confusables.tsv): ../../../include/batch_llm/"
                             "data/confusables.tsv climbs out of the input's folder s3://"}


def _check_accounting(summary: dict, rows: dict[str, dict], errors: dict[str, str], bad: dict = BAD,
                      infer_errors: int = 1) -> None:
    assert set(rows) == GOOD, sorted(rows)
    assert set(errors) == set(bad), sorted(errors)
    for rid, reason in bad.items():
        assert reason in errors[rid], (rid, errors[rid])
    r = summary["rows"]
    assert r["read"] == len(GOOD) + len(BAD) == r["published"] + r["plan_errors"] + r["infer_errors"] + r["dropped"]
    assert (r["infer_errors"], r["dropped"]) == (infer_errors, 0)  # the cut JPEG, found when its shard decoded it


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """The committed corpus, copied, and the 50 MB image (a PNG header, then zeros: it is refused by its size)."""
    images = tmp_path_factory.mktemp("vl") / "images"
    shutil.copytree(CORPUS, images)
    with open(images / "huge.png", "wb") as f:
        f.write((CORPUS / "red.png").read_bytes())
        f.truncate(50 * 2**20)
    tiny_models.build_tiny_vl_model()
    return images


@pytest.fixture(scope="module")
def cli_run(corpus) -> tuple[Path, tuple[dict, dict[str, dict], dict[str, str]], str]:
    out = corpus.parent / "out"
    run = run_in_group([sys.executable, "-m", "batch_llm", "run", str(PIPELINE), "--input", str(corpus / "rows.jsonl"),
                        "--output", str(out), "--ds", DS, "--run-id", "cli-images", "--plain"],
                       timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return out, _published(out, "image_review_demo"), run.stdout


def _generated(out: Path) -> dict[str, dict]:
    """The CLI run's shard outputs: the captions as generated (the review may mask the published ones)."""
    shard = out / "image_review_demo" / "runs" / f"dt={DS}" / "cli-images" / "infer" / "shard-00000"
    return {r["id"]: r for r in iter_jsonl(shard / "outputs.jsonl")}


def test_batch_llm_run_publishes_every_good_row_once_and_every_bad_row_with_its_reason(cli_run):
    out, (summary, rows, errors), _ = cli_run
    _check_accounting(summary, rows, errors)
    # the images reached the model: the same picture (a file, an inline data: URL) the same caption, another one
    # another caption; every row wrote its budget
    made = _generated(out)
    assert made["good-red"]["output"] == made["good-red-inline"]["output"] != made["good-blue"]["output"]
    assert all(r["completion_tokens"] == 8 for r in rows.values())
    # one text, one image each: the same prompt length (BLIP-2's 4 image tokens go before the text), counted by vLLM
    assert rows["good-red"]["prompt_tokens"] == rows["good-blue"]["prompt_tokens"] == \
        rows["good-green"]["prompt_tokens"] > 4


def test_the_shard_keys_images_by_content_and_generates_one_picture_once(cli_run):
    out, _, _ = cli_run
    shard = out / "image_review_demo" / "runs" / f"dt={DS}" / "cli-images" / "infer" / "shard-00000"
    manifest = read_json(Location(str(shard)).child("manifest.json").path())
    assert manifest["engine"]["kind"] == "vllm" and manifest["engine"]["settings"]["max_model_len"] == 512
    # vLLM's multimodal processor builds its Hugging Face processor once and keeps it (engines.vllm_engine)
    assert manifest["engine"]["settings"]["hf_processor_kept"] is True
    m = manifest["metrics"]
    # six planned rows: red, red inline (one picture: one request), blue, green, text, the cut JPEG
    assert m["rows"] == 6 and m["unique_prompts"] == 5 and m["errors"] == 1
    outputs = _generated(out)
    assert outputs["good-red"]["key"] == outputs["good-red-inline"]["key"] != outputs["good-blue"]["key"]


def test_the_image_review_asks_whether_each_caption_agrees_with_its_image(cli_run):
    out, (summary, rows, _), stdout = cli_run
    review = summary["manifests"]["filter"]["summary"]["review"]
    assert review["rows_reviewed"] == len(GOOD) and review["requests"] == len(GOOD)
    assert sum(review["verdicts"].values()) == len(GOOD) and review["input_tokens"] > 0
    assert set(review["categories"]) <= {"violence", "other", "image_mismatch"}
    run_dir = out / "image_review_demo" / "runs" / f"dt={DS}" / "cli-images" / "review"
    [requests] = list((run_dir / "requests").glob("shard-00000-*.jsonl"))
    asked = {_row_of(q["id"]): q for q in iter_jsonl(requests)}
    made = _generated(out)
    for rid in GOOD - {"good-text"}:
        turn = asked[rid]["messages"][-1]["content"]
        assert turn[0]["type"] == "image" and len(asked[rid]["images"]) == 1, asked[rid]
        assert "agree with the image" in turn[1]["text"] and made[rid]["output"] in turn[1]["text"]
    assert isinstance(asked["good-text"]["messages"][-1]["content"], str)  # no image: the ordinary review prompt
    for r in rows.values():
        assert r["review_verdict"] in ("safe", "unsafe", "error")
        if r["review_verdict"] == "unsafe" and r["review_categories"] == ["image_mismatch"]:
            assert set(r["output"]) == {"*"}  # actions: image_mismatch: mask
    manifest = read_json(Location(str(run_dir)).child("shard-00000", "manifest.json").path())
    assert manifest["engine"]["kind"] == "vllm" and manifest["metrics"]["engine_start_seconds"] > 0
    assert "content review: " in stdout


@pytest.fixture(scope="module")
def transformers_run(corpus) -> tuple[Path, tuple[dict, dict[str, dict], dict[str, str]]]:
    """The same corpus through the portable fallback: engine.kind transformers (BLIP-2 as
    AutoModelForImageTextToText with its processor) for the captions and for the image-text review (which decodes
    freely there, guided_decoding: false: transformers has no schema decoding), with no engine.limit_mm_per_prompt:
    the row with two images reaches the engine."""
    out = corpus.parent / "out-transformers"
    run = run_in_group([sys.executable, "-m", "batch_llm", "run", str(PIPELINE), "--input", str(corpus / "rows.jsonl"),
                        "--output", str(out), "--ds", DS, "--run-id", "cli-images-hf", "--plain",
                        "--set", "engine.kind=transformers", "--set", "engine.limit_mm_per_prompt=null",
                        "--set", "filter.review.engine={kind: transformers, max_model_len: 512}",
                        "--set", "filter.review.guided_decoding=false"], timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return out, _published(out, "image_review_demo")


def test_the_transformers_engine_takes_the_same_images_as_vllm(cli_run, transformers_run):
    """Every good row once, every bad row with its reason, as on vLLM (the row with two images refused by the
    engine, BLIP-2 taking one: the model would drop the second silently); each image reached the model (one picture
    one caption, another another; the text-only row through BLIP-2's language model), and every prompt is as long
    as vLLM made it: the processor put the 4 image tokens where vLLM's did."""
    out, (summary, rows, errors) = transformers_run
    bad = {**BAD, "bad-two-images": "the row has 2 images; Blip2ForConditionalGeneration takes 1 per prompt"}
    _check_accounting(summary, rows, errors, bad, infer_errors=2)
    shard = out / "image_review_demo" / "runs" / f"dt={DS}" / "cli-images-hf" / "infer" / "shard-00000"
    manifest = read_json(Location(str(shard)).child("manifest.json").path())
    assert manifest["engine"]["kind"] == "transformers"
    made = {r["id"]: r for r in iter_jsonl(shard / "outputs.jsonl")}
    assert made["good-red"]["output"] == made["good-red-inline"]["output"] != made["good-blue"]["output"]
    assert all(r["completion_tokens"] == 8 for r in rows.values())
    _, (_, vllm_rows, _), _ = cli_run
    assert {k: r["prompt_tokens"] for k, r in rows.items()} == {k: r["prompt_tokens"] for k, r in vllm_rows.items()}
    # the review on transformers: every good row reviewed once, with its image where it has one; the random model's
    # free text is no verdict: each a review error, flagged (on_error: flag), none dropped
    review = summary["manifests"]["filter"]["summary"]["review"]
    assert review["rows_reviewed"] == review["requests"] == len(GOOD) and review["verdicts"] == {"error": len(GOOD)}
    run_dir = out / "image_review_demo" / "runs" / f"dt={DS}" / "cli-images-hf" / "review"
    manifest = read_json(Location(str(run_dir)).child("shard-00000", "manifest.json").path())
    assert manifest["engine"]["kind"] == "transformers"
    reviewed = {_row_of(r["id"]): r for r in iter_jsonl(run_dir / "shard-00000" / "errors.jsonl")}
    assert set(reviewed) == GOOD and all(r["error_kind"] == "invalid_output" for r in reviewed.values())
    asked = {_row_of(q["id"]): q for q in iter_jsonl(next((run_dir / "requests").glob("shard-00000-*.jsonl")))}
    assert all(len(asked[rid].get("images") or []) == (rid != "good-text") for rid in GOOD)
    assert all(r["review_verdict"] == "error" for r in rows.values())


@pytest.fixture(scope="module")
def dag_run(cli_run, corpus, airflow_db, s3, tmp_path_factory):
    """The corpus in the S3 server's bucket, read through Airflow connection ``lake`` (``input.conn_id``): the rows
    file and, relative to it, its images (the planner checks them there, the shards read them there)."""
    import s3fs
    from batch_llm_airflow.dag_factory import pipeline_dag

    cli_out, _, _ = cli_run
    fs = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False, **s3.storage_options())
    for f in sorted(corpus.iterdir()):
        fs.put_file(str(f), f"{s3.bucket}/vl/images/{f.name}")
    out = tmp_path_factory.mktemp("vl_dag") / "out"
    # named as the demo DAG: dag.test() runs a DAG its dags folder holds (it looks its version up by id)
    cfg = load_config(PIPELINE).with_overrides({
        "name": "batch_llm_demo", "input.path": f"s3://{s3.bucket}/vl/images/rows.jsonl", "input.conn_id": "lake",
        "output.path": str(out), "sharding.num_shards": 2, "cache.path": str(cli_out / "_cache" / "results")})
    dr = pipeline_dag(cfg, source="image_review_pipeline.yaml (test)").test(
        logical_date=dt.datetime.fromisoformat(DS).replace(tzinfo=dt.timezone.utc))
    return dr, _published(out, "batch_llm_demo")


def test_the_dag_accounts_for_the_same_corpus_from_the_cache(cli_run, dag_run):
    _, (cli_summary, cli_rows, _), _ = cli_run
    dr, (summary, rows, errors) = dag_run
    assert str(dr.state) in ("success", "DagRunState.SUCCESS"), dr.state
    states = {ti.task_id.split(".")[-1]: str(ti.state) for ti in dr.get_task_instances()}
    assert {"plan_shards", "batch_inference", "fetch_review_model", "review", "publish"} <= set(states), states
    _check_accounting(summary, rows, errors, IN_STORAGE)
    # the same pictures (their content hashes), so the same captions, all from the first run's cache
    assert {k: r["output"] for k, r in rows.items()} == {k: r["output"] for k, r in cli_rows.items()}
    review, first = (s["manifests"]["filter"]["summary"]["review"] for s in (summary, cli_summary))
    # a review whose verdict was an error (the random model's JSON cut at max_tokens) is not cached: asked again
    assert review["shards"] == [0, 1] and review["requests"] == first["requests"]
    assert review["cached_requests"] == first["requests"] - first["verdicts"].get("error", 0) > 0
    assert sum(review["verdicts"].values()) == sum(first["verdicts"].values()) == len(GOOD)


def test_a_row_whose_images_the_processor_refuses_fails_alone_on_transformers(corpus):
    """The transformers engine over three image rows in one batch, the middle one's image something the processor
    cannot take: that row is an error with the processor's reason, the other two are generated (the batch tried
    again row by row), a text-only request goes to BLIP-2's language model, and engine.mm_processor_kwargs reach the
    processor (do_normalize: false leaves the pixels in [0, 1]; normalized, red's blue and green go below 0)."""
    from batch_llm.config import EngineConfig, SamplingConfig
    from batch_llm.engines.base import GenRequest
    from batch_llm.engines.transformers_engine import TransformersEngine
    from PIL import Image

    engine = TransformersEngine(str(tiny_models.build_tiny_vl_model()),
                                EngineConfig(kind="transformers", mm_processor_kwargs={"do_normalize": False}),
                                SamplingConfig(max_tokens=4, temperature=0.0, ignore_eos=True))
    engine.start()
    try:
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
        text = engine.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = engine.tok(text, add_special_tokens=False)["input_ids"]
        red, blue = (Image.open(corpus / name).convert("RGB") for name in ("red.png", "blue.jpg"))
        requests = [GenRequest(key="red", prompt_token_ids=ids, prompt_text=text, images=[red]),
                    GenRequest(key="odd", prompt_token_ids=ids, prompt_text=text, images=[{"not": "a picture"}]),
                    GenRequest(key="blue", prompt_token_ids=ids, prompt_text=text, images=[blue]),
                    GenRequest(key="text", prompt_token_ids=ids, prompt_text=text)]
        results = {r.key: r for r in engine.generate(requests)}
        pixels = engine._image_inputs([(requests[0], engine.sampling_for(requests[0]))], False)["pixel_values"]
        assert 0.0 <= float(pixels.min()) and float(pixels.max()) <= 1.0
        assert float(engine.processor(text=[text], images=[[red]], return_tensors="pt")["pixel_values"].min()) < 0
    finally:
        engine.close()
    assert set(results) == {"red", "odd", "blue", "text"}
    assert results["odd"].error and results["odd"].error.startswith("transformers could not take the row's images: ")
    for key in ("red", "blue", "text"):
        assert results[key].error is None and results[key].completion_tokens == 4, results[key]
    assert results["red"].prompt_tokens == results["blue"].prompt_tokens == len(ids) + tiny_models.VL_QUERY_TOKENS
    assert results["text"].prompt_tokens == len(ids)
