"""OpenLineage: the publish task's datasets as the OpenLineage provider extracts them (its ExtractorManager, the
code path its listener takes after a task succeeds) and as the real client's console transport emits them."""
from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
from batch_llm.layout import RunLayout
from batch_llm.manifests import FetchManifest, PublishManifest, TokenUsage
from batch_llm_airflow.lineage import dataset_name
from batch_llm_airflow.operators import PublishOperator
from helpers import demo_config

pytest.importorskip("airflow.providers.openlineage")


@pytest.mark.parametrize("url, expected", [
    ("s3://lake@bucket/llm/pipe/v=1/data.parquet", ("s3://bucket", "llm/pipe/v=1/data.parquet")),
    ("s3://bucket/prompts/dt=2026-11-30/", ("s3://bucket", "prompts/dt=2026-11-30/")),
    ("/data/in.jsonl", ("file", "/data/in.jsonl")),
    ("file:///data/in.jsonl", ("file", "/data/in.jsonl")),
])
def test_dataset_names_follow_openlineage_naming_without_the_connection(url, expected):
    assert dataset_name(url) == expected


def _published_run(tmp_path):
    cfg = demo_config(tmp_path, input__path="s3://lake@prompts-bucket/reviews/dt={ds}/")
    layout = RunLayout.for_run(cfg, run_id="manual__t", ds="2026-11-30")
    version = f"{tmp_path}/out/{cfg.name}/dt=2026-11-30/v=20261130T010203"
    published = PublishManifest(partition=f"{tmp_path}/out/{cfg.name}/dt=2026-11-30", version=version,
                                dataset=f"{version}/data.parquet", rows=40, summary=f"{version}/summary.json",
                                errors=f"{version}/errors.jsonl", error_rows=3,
                                usage=TokenUsage(prompt_tokens=900, cached_prompt_tokens=100, completion_tokens=640))
    fetched = FetchManifest(source="modelscope", id="HuggingFaceTB/SmolLM2-135M-Instruct", revision="master",
                            local_dir=str(tmp_path / "m"), cache_hit=True, files=[], total_bytes=0,
                            content_hash="ab" * 32, model_key="HuggingFaceTB/SmolLM2-135M-Instruct@master#abab")
    return cfg, layout, published, fetched


def test_publish_lineage_through_the_provider_and_the_console_transport(tmp_path, caplog):
    from airflow.providers.openlineage.extractors.manager import ExtractorManager
    from airflow.utils.state import TaskInstanceState
    from openlineage.client import OpenLineageClient
    from openlineage.client.event_v2 import Job, Run, RunEvent, RunState
    from openlineage.client.transport.console import ConsoleConfig, ConsoleTransport
    from openlineage.client.uuid import generate_new_uuid

    cfg, layout, published, fetched = _published_run(tmp_path)
    op = PublishOperator(task_id="publish", pipeline_config=cfg.model_dump(mode="json"))
    op._lineage_of_run = (cfg, layout, published, fetched)  # what execute() leaves for the listener
    ti = SimpleNamespace(task_id="publish", dag_id="d", run_id="manual__t", try_number=1, map_index=-1)
    lineage = ExtractorManager().extract_metadata(SimpleNamespace(run_id="manual__t"), op,
                                                  TaskInstanceState.SUCCESS, ti)
    assert [(d.namespace, d.name) for d in lineage.inputs] == [
        ("s3://prompts-bucket", "reviews/dt=2026-11-30/"), ("modelscope", "HuggingFaceTB/SmolLM2-135M-Instruct")]
    assert [(d.namespace, d.name) for d in lineage.outputs] == [("file", published.dataset)]

    client = OpenLineageClient(transport=ConsoleTransport(ConsoleConfig()))
    event = RunEvent(eventType=RunState.COMPLETE, eventTime="2026-11-30T01:02:03Z",
                     run=Run(runId=str(generate_new_uuid()), facets=lineage.run_facets),
                     job=Job(namespace="default", name="d.publish"), producer="test",
                     inputs=lineage.inputs, outputs=lineage.outputs)
    with caplog.at_level(logging.INFO, logger="openlineage.client.transport.console"):
        client.emit(event)
    (line,) = [r.getMessage() for r in caplog.records if r.name == "openlineage.client.transport.console"]
    sent = json.loads(line)
    model = sent["inputs"][1]
    assert model["facets"]["version"]["datasetVersion"] == "master#" + "ab" * 8
    out = sent["outputs"][0]
    assert out["facets"]["version"]["datasetVersion"] == "v=20261130T010203"
    assert out["outputFacets"]["outputStatistics"]["rowCount"] == 40
    facet = sent["run"]["facets"]["batch_llm"]
    assert (facet["pipeline"], facet["engine"], facet["rows_published"], facet["rows_with_errors"]) == (
        cfg.name, "vllm", 40, 3)
    assert (facet["prompt_tokens"], facet["completion_tokens"]) == (900, 640)
    assert facet["_schemaURL"].endswith("#batchllmrunfacet")
