"""One batch task, hosted or on your GPUs: switch by changing the operator alone.

common-ai's example (``airflow/providers/common/ai/example_dags/example_llm_batch.py``, 1.0.0) classifies
product reviews with ``LLMBatchOperator`` and summarizes summaries with ``@task.llm_batch``; this DAG is that
example with each of the two tasks written for both backends. The arguments they share are the same objects;
what differs is the operator (or decorator) and the arguments only it has:

    LLMBatchOperator(**CLASSIFY, llm_conn_id="pydanticai_default", model_id="openai:gpt-5-mini", deferrable=True)
    GPULLMBatchOperator(**CLASSIFY, model_id="HuggingFaceTB/SmolLM2-135M-Instruct", config=DEMO_YAML)

``build_summary_requests`` is defined once and used twice: called (one batch) and mapped
(``.override(task_id=...).expand(reviews=[...])``: one batch per group of reviews, each with its own result file),
the same code under either decorator; only the line choosing ``batch_task`` differs.

The reader downstream (``summarize_manifest``, common-ai's own ``howto_operator_llm_batch_read_results``) is the
same code for both: the manifest and the rows have the same keys.

``LLM_BATCH_BACKEND=common_ai`` (read when the file is parsed) builds the hosted variant; it needs
``apache-airflow-providers-common-ai`` and a ``pydanticai`` connection with an API key. The default, ``gpu``,
runs on this project's engines (the demo pipeline's: SmolLM2-135M on the CPU vLLM engine) and needs neither.
"""
from __future__ import annotations

import datetime as dt
import json
import os
from pathlib import Path
from typing import Literal

from airflow.sdk import DAG, ObjectStoragePath, task
from pydantic import BaseModel, Field

BACKEND = os.environ.get("LLM_BATCH_BACKEND", "gpu")  # "gpu" (this project) or "common_ai" (hosted)
DEMO_YAML = Path(__file__).parent / "pipelines" / "demo.yaml"      # engine, sharding, model cache of the demo
GPU_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
RESULT_ROOT = str(Path(__file__).resolve().parents[1] / "var" / "output" / "llm_batch_switch")

REVIEWS = [
    "Absolutely loved it, would buy again.",
    "Broke after one use, very disappointed.",
    "Does what it says on the box. Nothing special.",
    "Shipping took three weeks but the product itself is great.",
]


class Sentiment(BaseModel):
    """Structured output requested from every request in the batch (common-ai's example model)."""

    label: Literal["positive", "negative", "neutral"]
    confidence: float = Field(ge=0, le=1)
    reason: str


@task
def summarize_manifest(manifest: dict) -> dict[str, int]:
    """Reads the landed JSONL rows back; the XCom value is only the manifest. common-ai's example reader,
    unchanged, plus the counts per status."""
    rows = [json.loads(line) for line in ObjectStoragePath(manifest["result_uri"]).read_text().splitlines() if line]
    by_label: dict[str, int] = {}
    for row in rows:
        if row["status"] == "success":
            key = row["output"]["label"] if isinstance(row["output"], dict) else "text"
            by_label[key] = by_label.get(key, 0) + 1
        else:
            # ``error`` (refused or failed) or ``invalid_output`` (schema mismatch, original text in ``raw_output``)
            print(f"request {row['index']} -> {row['status']}: {row['error'] or row['raw_output']}")
    return {**by_label, **{f"status:{k}": v for k, v in manifest["counts"].items() if v}}


@task
def count_mapped(manifests: list[dict]) -> dict:
    """A mapped batch's XCom is the list of its manifests (one per map index), with either provider."""
    manifests = list(manifests)
    return {"batches": len(manifests), "requests": sum(m["request_count"] for m in manifests),
            "result_uris": [m["result_uri"] for m in manifests]}


def build_dag(backend: str = BACKEND, *, dag_id: str = "example_llm_batch_switch", result_root: str = RESULT_ROOT,
              gpu_overrides: dict | None = None) -> DAG:
    """The DAG for one backend. ``gpu_overrides`` are config keys for the GPU batch (the tests run it on the
    transformers engine)."""
    # One folder per DAG run: retries of a run re-attach to their batch, other runs never share results.
    root = f"{result_root}/{{{{ dag.dag_id }}}}/{{{{ run_id }}}}"
    classify_args = dict(task_id="classify_reviews", requests=[f"Review: {r!r}" for r in REVIEWS],
                         result_path=f"{root}/classify", system_prompt="Classify the sentiment of this product review.",
                         output_type=Sentiment, max_tokens=64)
    summaries_args = dict(result_path=f"{root}/summaries", system_prompt="Summarize the review in one short sentence.",
                          max_tokens=24)
    with DAG(dag_id, schedule=None, start_date=dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc),
             tags=["batch_llm", "example", "common-ai"], default_args={"retries": 1}) as dag:
        if backend == "common_ai":
            from airflow.providers.common.ai.operators.llm_batch import LLMBatchOperator

            classify = LLMBatchOperator(**classify_args, llm_conn_id="pydanticai_default", model_id="openai:gpt-5-mini",
                                        deferrable=True)
            batch_task = task.llm_batch(**summaries_args, llm_conn_id="pydanticai_default", model_id="openai:gpt-5-mini")
        else:
            from batch_llm_airflow.llm_batch import GPULLMBatchOperator

            classify = GPULLMBatchOperator(**classify_args, model_id=GPU_MODEL, config=DEMO_YAML,
                                           config_overrides=gpu_overrides)
            batch_task = task.gpu_llm_batch(**summaries_args, model_id=GPU_MODEL, config=DEMO_YAML,
                                            config_overrides=gpu_overrides)

        @batch_task
        def build_summary_requests(reviews: list[str]) -> list[str]:
            return [f"Review: {r!r}" for r in reviews]

        summarize_manifest(classify.output)
        summarize_manifest.override(task_id="summarize_summaries")(build_summary_requests(REVIEWS))
        # The same task mapped: one batch per group of reviews (common-ai's .expand(), on either provider).
        count_mapped(build_summary_requests.override(task_id="summaries_by_group").expand(
            reviews=[REVIEWS[:2], REVIEWS[2:]]))
    return dag


dag = build_dag()
