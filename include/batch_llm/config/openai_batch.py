"""The ``openai_batch`` section: which OpenAI Batch API ``model`` names and ``endpoint``s a pipeline serves, and the
limits of a batch's input file. ``batch_llm.batch_api`` reads it; the Airflow plugin's ``/v1/batches`` routes pick
the pipeline whose section names a batch's model (``batch_llm_airflow.openai_app``).

Only this section of a pipeline YAML is validated in the API server (``parse_section``): the whole config would
import an output schema's ``module:Class``, DAG authors' code, which Airflow 3 keeps out of its API server."""
from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

Endpoint = Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]
#: The endpoints of each ``engine.task``, its default first: a generating pipeline answers chat and completions
#: requests, an embedding pipeline embeddings requests; a classifier's class probabilities have no OpenAI endpoint.
TASK_ENDPOINTS: dict[str, tuple[str, ...]] = {"generate": ("/v1/chat/completions", "/v1/completions"),
                                              "embed": ("/v1/embeddings",), "classify": ()}
#: OpenAI's documented defaults: 50,000 requests and 200 MB per batch input file.
MAX_REQUESTS = 50_000
MAX_FILE_BYTES = 200 * 10**6
_WINDOW = re.compile(r"([1-9][0-9]*)([smh])")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600}


def window_seconds(window: str) -> int:
    """``"24h"`` → 86400; ValueError for anything but ``<n>s``, ``<n>m`` or ``<n>h``."""
    m = _WINDOW.fullmatch(window)
    if not m:
        raise ValueError(f"completion window {window!r} is not <n>h, <n>m or <n>s")
    return int(m.group(1)) * _UNIT_SECONDS[m.group(2)]


def _chat_only() -> list[Endpoint]:
    return ["/v1/chat/completions"]


def with_task_endpoints(section: Any, task: Any) -> Any:
    """An ``openai_batch`` mapping as a YAML file holds it, ``endpoints`` filled where it names none: the task's
    default endpoint (``/v1/embeddings`` for engine.task embed, else chat), so an embedding pipeline needs no
    endpoints key. Anything that is no mapping is returned as it is (validation says what is wrong)."""
    if not isinstance(section, dict) or section.get("endpoints") is not None:
        return section
    served = TASK_ENDPOINTS.get(task if isinstance(task, str) else "generate")
    return {**section, "endpoints": list(served[:1])} if served else section


class OpenAIBatchConfig(BaseModel):
    """The OpenAI Batch API served by this pipeline (``/v1/batches`` in the Airflow API server, docs/openai-batch-api.md):
    a batch whose ``model`` is one of ``models`` and whose ``endpoint`` is one of ``endpoints`` is a run of this
    pipeline's DAG over the batch's input file. null (the default): the pipeline serves no batches."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    models: list[str] = Field(min_length=1, description="The model names (body.model of a batch's input lines) whose "
                              "batches this pipeline runs; one pipeline per name in a deployment")
    endpoints: list[Endpoint] = Field(default_factory=_chat_only, min_length=1,
                                      description="The batch endpoints served: /v1/chat/completions and "
                                      "/v1/completions by a generating pipeline (engine.task: generate), "
                                      "/v1/embeddings by an embedding one (engine.task: embed). Default: "
                                      "/v1/chat/completions, or /v1/embeddings for engine.task: embed")
    completion_windows: list[str] = Field(default_factory=lambda: ["24h"], min_length=1, description="The "
                                          "completion_window values a batch may ask for (<n>h, <n>m or <n>s; "
                                          "OpenAI's only one is 24h): a batch not done by then expires, its "
                                          "finished requests published and the rest answered batch_expired")
    max_requests_per_file: int = Field(MAX_REQUESTS, gt=0, description="The most request lines a batch's "
                                       "input file may have (OpenAI: 50,000); more fails the batch")
    max_file_bytes: int = Field(MAX_FILE_BYTES, gt=0, description="The largest input file a batch may read, in "
                                "bytes (OpenAI: 200 MB); uploads are bounded by the deployment's own limit "
                                "(BATCH_LLM_OPENAI_MAX_UPLOAD_BYTES)")

    @field_validator("models")
    @classmethod
    def _distinct_names(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v) or any(not m.strip() for m in v):
            raise ValueError(f"name each model once, none empty: {v}")
        return v

    @field_validator("endpoints")
    @classmethod
    def _distinct_endpoints(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError(f"name each endpoint once: {v}")
        return v

    @field_validator("completion_windows")
    @classmethod
    def _windows(cls, v: list[str]) -> list[str]:
        for w in v:
            window_seconds(w)
        return v

    def endpoint_problem(self, task: str) -> str | None:
        """Why an endpoint is not one a pipeline of ``engine.task`` answers; None when all are."""
        wrong = [e for e in self.endpoints if e not in TASK_ENDPOINTS.get(task, ())]
        if wrong:
            return (f"openai_batch.endpoints: {', '.join(wrong)} not answered by engine.task {task} (it answers "
                    f"{', '.join(TASK_ENDPOINTS.get(task, ())) or 'no OpenAI endpoint'}"
                    f"{_other_task(wrong[0])})")
        return None


def _other_task(endpoint: str) -> str:
    """Which engine.task answers ``endpoint``, as a hint ("" where none does)."""
    task = next((t for t, served in TASK_ENDPOINTS.items() if endpoint in served), None)
    return f"; {endpoint} is answered by engine.task: {task}" if task else ""


def parse_section(data: Any, source: str = "openai_batch") -> OpenAIBatchConfig | None:
    """The section as one pipeline YAML's mapping holds it (None where it has none), validated alone, its
    endpoints the task's default where it names none; ValueError naming ``source`` when it is invalid."""
    if not isinstance(data, dict) or data.get("openai_batch") is None:
        return None
    engine = data.get("engine")
    task = engine.get("task") if isinstance(engine, dict) else None
    try:
        return OpenAIBatchConfig.model_validate(with_task_endpoints(data["openai_batch"], task or "generate"))
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ValueError(f"{source}: openai_batch{'.' + where if where else ''}: {first['msg']}") from None
