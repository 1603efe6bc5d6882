"""Runs ready to publish (plan and filter committed, no engine) and what the publish tests look at."""
from __future__ import annotations

from batch_llm.config import parse_config
from batch_llm.io.storage import Location, exists, write_jsonl
from batch_llm.layout import RunLayout
from batch_llm.manifests import EvaluateManifest, FilterManifest, FilterSummary, PlanManifest, ShardSpec

IDS = ["a", "b", "c"]
PIPELINE, PARTITION = "race", "dt=2026-12-03"


def ready_to_publish(root: Location, run_id: str, *, part: str = PARTITION, **output) -> tuple:
    """A run of pipeline ``race``, partition ``part``, with its plan and filter committed (three rows): the
    arguments of ``publish``. ``output``: more ``output.*`` settings."""
    cfg = parse_config({"name": PIPELINE, "model": {"ref": "org/m"}, "input": {"path": "/nonexistent/in.jsonl"},
                        "output": {"path": root.url, **output}, "cache": {"enabled": False}})
    layout = RunLayout(output_root=root, pipeline=PIPELINE, partition=part, run_id=run_id,
                       input=Location("/nonexistent/in.jsonl"))
    plan_dir, filt_dir = layout.stage("plan"), layout.stage("filter")
    write_jsonl(plan_dir.child("records.jsonl").path(),
                [{"idx": i, "id": k, "reference": None, "record": {"id": k, "prompt": "hi"}} for i, k in enumerate(IDS)])
    write_jsonl(plan_dir.child("errors.jsonl").path(), [])
    write_jsonl(filt_dir.child("outputs.jsonl").path(),
                [{"id": k, "idx": i, "output": f"answer of {run_id}", "prompt_tokens": 3, "completion_tokens": 2,
                  "finish_reason": "stop"} for i, k in enumerate(IDS)])
    write_jsonl(filt_dir.child("errors.jsonl").path(), [])
    plan = PlanManifest(input="in.jsonl", format="jsonl", rows_read=3, valid=3, invalid=0,
                        errors=plan_dir.child("errors.jsonl").url, records=plan_dir.child("records.jsonl").url,
                        shards=[ShardSpec(index=0, rows=3, url="unused")], has_references=False)
    filtered = FilterManifest(outputs=filt_dir.child("outputs.jsonl").url, rows=3,
                              inference_errors=filt_dir.child("errors.jsonl").url, inference_error_rows=0,
                              summary=FilterSummary(rows_scanned=3))
    return cfg, layout, plan, filtered, EvaluateManifest(skipped="test")


def partition(root: Location) -> Location:
    return root.child(PIPELINE, PARTITION)


def has_data(version_url: str, root: Location) -> bool:
    """Whether a version's dataset is there (S3 servers may list a removed folder's empty prefix)."""
    return exists(Location(version_url, root.options).child("data.jsonl").path())
