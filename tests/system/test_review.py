"""Content review by a model (``filter.review``) on the real CPU vLLM engine, through ``batch-llm run`` with a
pipeline YAML: the demo model generates, then reviews its own outputs as a generate-style "guard" whose answer is
decoded under the verdict's JSON schema. Its verdicts mean nothing (a 135M chat model is no guard); what is checked
is the machinery and the accounting: every row reviewed once, every verdict a valid one, each action applied,
every input line published or in the errors once. Then the same pipeline through Airflow's dag.test() in two shards,
on the first run's result cache: the review tasks run mapped over the shards, every review a cache hit, the same
verdicts.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml
from batch_llm.io.storage import Location, iter_jsonl, read_json
from helpers import run_in_group

ROOT = Path(__file__).resolve().parents[2]
DS = "2026-12-03"
INPUT = ROOT / "include" / "sample_data" / "demo_prompts.jsonl"
CATEGORIES = ["violence", "privacy", "other"]


def _pipeline(tmp: Path) -> Path:
    engine = {"kind": "vllm", "max_model_len": 1024, "enforce_eager": True, "commit_every_rows": 8,
              "max_error_rate": 0.5}
    cfg = {
        "name": "review_demo", "model": {"ref": "HuggingFaceTB/SmolLM2-135M-Instruct"},
        "input": {"path": str(INPUT)}, "sharding": {"num_shards": 1}, "engine": engine,
        "sampling": {"max_tokens": 24, "temperature": 0.0, "seed": 0},
        "filter": {"lists": [{"name": "watch", "path": str(ROOT / "dags/pipelines/wordlists/demo_watchlist.txt"),
                              "action": "mask", "fold": ["confusables", "separators"]}],
                   "review": {"model": {"ref": "HuggingFaceTB/SmolLM2-135M-Instruct"}, "engine": engine,
                              "categories": CATEGORIES, "max_tokens": 32, "action": "flag",
                              "actions": {"violence": "drop", "privacy": "mask"}, "on_error": "drop"}},
        "evaluate": {"enabled": False}, "output": {"path": str(tmp / "out")},
    }
    path = tmp / "review_demo.yaml"
    path.write_text(yaml.safe_dump(cfg, allow_unicode=True), encoding="utf-8")
    return path


def _run(pipeline: Path, run_id: str) -> tuple[dict, str]:
    run = run_in_group([sys.executable, "-m", "batch_llm", "run", str(pipeline), "--ds", DS, "--run-id", run_id,
                        "--plain"], timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = yaml.safe_load(pipeline.read_text())["output"]["path"]
    current = read_json(Location(out).child("review_demo", f"dt={DS}", "_CURRENT.json").path())
    return read_json(Location(current["version"]).child("summary.json").path()), run.stdout


@pytest.fixture(scope="module")
def runs(tmp_path_factory, demo_model_dir):
    tmp = tmp_path_factory.mktemp("review")
    return tmp, _run(_pipeline(tmp), "review-1")


def test_every_row_reviewed_once_with_a_valid_verdict(runs):
    tmp, (summary, stdout) = runs
    review = summary["manifests"]["filter"]["summary"]["review"]
    published = list(iter_jsonl(Location(summary["dataset"]).path()))
    errors = list(iter_jsonl(Location(summary["errors"]).path()))
    valid = summary["manifests"]["plan"]["valid"]
    infer_errors = summary["manifests"]["filter"]["inference_error_rows"]
    assert valid == 20 and review["rows_reviewed"] == valid - infer_errors  # the watchlist only masks
    assert review["requests"] == review["rows_reviewed"] and review["cached_requests"] == 0
    assert review["input_tokens"] > 0 and review["output_tokens"] > 0
    assert sum(review["verdicts"].values()) == review["rows_reviewed"]
    assert set(review["verdicts"]) <= {"safe", "unsafe", "error"} and set(review["categories"]) <= set(CATEGORIES)
    for r in published:
        assert r["review_verdict"] in ("safe", "unsafe") and set(r["review_categories"]) <= set(CATEGORIES)
        if r["review_verdict"] == "safe":
            assert r["review_categories"] == []
        if "privacy" in r["review_categories"] and "violence" not in r["review_categories"]:
            assert set(r["output"]) == {"*"}  # masked whole
    dropped = [e for e in errors if e["reason"].startswith(("dropped by review: ", "review failed: "))]
    assert len(dropped) == review["rows_dropped"]
    assert all("violence" in e["reason"] for e in errors if e["reason"].startswith("dropped by review: "))
    assert review["verdicts"].get("unsafe", 0) == sum(r["review_verdict"] == "unsafe" for r in published) + \
        sum(e["reason"].startswith("dropped by review: ") for e in errors)
    assert "content review: " in stdout


def test_every_input_line_published_or_in_the_errors_once(runs):
    _, (summary, _) = runs
    rows = summary["rows"]
    assert rows["read"] == rows["published"] + rows["plan_errors"] + rows["infer_errors"] + rows["dropped"]
    assert rows["error_lines"] == rows["plan_errors"] + rows["infer_errors"] + rows["dropped"]
    ids = [r["id"] for r in iter_jsonl(Location(summary["dataset"]).path())] + \
        [e["id"] for e in iter_jsonl(Location(summary["errors"]).path()) if e.get("id")]
    valid_ids = set()
    for line in INPUT.read_text(encoding="utf-8").splitlines():
        try:
            valid_ids.add(json.loads(line).get("id"))
        except ValueError:  # the planted line that is not JSON
            continue
    assert len(ids) == len(set(ids)) + 1  # the planted duplicate id q001: once published, once an error
    assert set(ids) <= valid_ids


def test_the_review_pass_is_a_committed_shard_of_its_own(runs):
    tmp, (summary, _) = runs
    run_dir = Location(str(tmp / "out")).child("review_demo", "runs", f"dt={DS}", "review-1")
    manifest = read_json(run_dir.child("review", "shard-00000", "manifest.json").path())
    review = summary["manifests"]["filter"]["summary"]["review"]
    assert manifest["metrics"]["rows"] == review["requests"]
    assert manifest["engine"]["kind"] == "vllm" and manifest["metrics"]["engine_start_seconds"] > 0
    assert read_json(run_dir.child("review", "model", "manifest.json").path())["id"] == \
        "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def dag_run(runs, airflow_db, tmp_path_factory):
    """The same pipeline through Airflow's dag.test(), in two shards, its result cache the CLI runs' (every row and
    every review a cache hit: the review tasks run the whole path, isolated worker included, without an engine)."""
    import datetime as dt

    from batch_llm.config import load_config
    from batch_llm_airflow.dag_factory import pipeline_dag

    tmp, _ = runs
    out = tmp_path_factory.mktemp("review_dag")
    # named as the demo DAG: dag.test() runs a DAG its dags folder holds (it looks its version up by id)
    cfg = load_config(tmp / "review_demo.yaml").with_overrides({
        "name": "batch_llm_demo", "output.path": str(out), "sharding.num_shards": 2,
        "cache.path": str(tmp / "out" / "_cache" / "results")})
    dr = pipeline_dag(cfg, source="review_demo.yaml (test)").test(
        logical_date=dt.datetime.fromisoformat(DS).replace(tzinfo=dt.timezone.utc))
    current = read_json(Location(str(out)).child("batch_llm_demo", f"dt={DS}", "_CURRENT.json").path())
    return dr, read_json(Location(current["version"]).child("summary.json").path())


def test_the_dag_reviews_every_shard_from_the_cache(runs, dag_run):
    _, (cli, _) = runs
    dr, summary = dag_run
    assert str(dr.state) in ("success", "DagRunState.SUCCESS"), dr.state
    states = {ti.task_id.split(".")[-1]: str(ti.state) for ti in dr.get_task_instances()}
    assert {"fetch_review_model", "review"} <= set(states), states
    review = summary["manifests"]["filter"]["summary"]["review"]
    a = cli["manifests"]["filter"]["summary"]["review"]
    # a review whose verdict was an error (an answer cut at max_tokens) is not cached: it is asked again, and may
    # come out otherwise in another batch
    errors = a["verdicts"].get("error", 0)
    assert review["shards"] == [0, 1] and review["requests"] == a["requests"]
    assert review["cached_requests"] == a["requests"] - errors and review["cached_requests"] > 0
    assert sum(review["verdicts"].values()) == sum(a["verdicts"].values())
    if not errors:
        assert (review["verdicts"], review["categories"]) == (a["verdicts"], a["categories"])
    assert summary["rows"]["published"] == cli["rows"]["published"]
