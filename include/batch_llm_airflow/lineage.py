"""OpenLineage for a pipeline run: what its publish task read (the input table, the model) and wrote (the
published dataset), handed to the OpenLineage provider's listener through ``get_openlineage_facets_on_complete``.

Optional: the provider (``apache-airflow-providers-openlineage``, the ``openlineage`` extra) is imported only
when its listener asks, so the operators run without it. Names follow OpenLineage's dataset naming:
``s3://[conn@]bucket/key`` is namespace ``s3://bucket``, name ``key``; a local path is namespace ``file``, name
the absolute path; a ModelScope model is namespace ``modelscope``, name its id, versioned by its revision and
weights hash.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import attr

if TYPE_CHECKING:
    from airflow.providers.openlineage.extractors import OperatorLineage
    from batch_llm.config import PipelineConfig
    from batch_llm.layout import RunLayout
    from batch_llm.manifests import FetchManifest, PublishManifest

PRODUCER = "https://github.com/batch-llm/batch-llm"


def dataset_name(url: str) -> tuple[str, str]:
    """(namespace, name) of a storage URL under OpenLineage's naming rules; an Airflow connection id
    (``s3://conn@bucket``) is not part of the dataset's identity and is dropped."""
    parts = urlsplit(url)
    if parts.scheme in ("", "file", "local"):
        return "file", parts.path if parts.scheme else url
    bucket = parts.netloc.rsplit("@", 1)[-1]
    return f"{parts.scheme}://{bucket}", parts.path.lstrip("/")


def _run_facet_class():
    """The run facet class, built on first use (its base class comes from the optional OpenLineage client)."""
    from openlineage.client.facet_v2 import RunFacet

    @attr.define
    class BatchLlmRunFacet(RunFacet):
        """What produced the published rows: the pipeline, model key, engine and outcome counts."""

        pipeline: str
        model_key: str
        engine: str
        rows_published: int
        rows_with_errors: int
        prompt_tokens: int
        completion_tokens: int

        @staticmethod
        def _get_schema() -> str:
            return f"{PRODUCER}/blob/main/README.md#batchllmrunfacet"

    return BatchLlmRunFacet


def publish_lineage(cfg: PipelineConfig, layout: RunLayout, published: PublishManifest,
                    model: FetchManifest) -> OperatorLineage:
    """The publish task's lineage: inputs the table and the model, output the published dataset."""
    from airflow.providers.openlineage.extractors import OperatorLineage
    from openlineage.client.event_v2 import InputDataset, OutputDataset
    from openlineage.client.generated.dataset_version_dataset import DatasetVersionDatasetFacet
    from openlineage.client.generated.output_statistics_output_dataset import OutputStatisticsOutputDatasetFacet

    model_ns, model_name = ("modelscope", model.id) if model.source == "modelscope" else dataset_name(model.id)
    version = f"{model.revision or ''}#{model.content_hash[:16]}".lstrip("#")
    inputs = [InputDataset(*dataset_name(layout.input.url)),
              InputDataset(model_ns, model_name, facets={"version": DatasetVersionDatasetFacet(version)})]
    out_ns, out_name = dataset_name(published.dataset)
    outputs = [OutputDataset(out_ns, out_name, facets={"version": DatasetVersionDatasetFacet(
                                 published.version.rstrip("/").rsplit("/", 1)[-1])},
                             outputFacets={"outputStatistics": OutputStatisticsOutputDatasetFacet(
                                 rowCount=published.rows)})]
    facet: Any = _run_facet_class()(
        pipeline=cfg.name, model_key=model.model_key, engine=cfg.engine.kind, rows_published=published.rows,
        rows_with_errors=published.error_rows, prompt_tokens=published.usage.prompt_tokens,
        completion_tokens=published.usage.completion_tokens)
    return OperatorLineage(inputs=inputs, outputs=outputs, run_facets={"batch_llm": facet})
