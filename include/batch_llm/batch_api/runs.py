"""A batch as a run of a pipeline: which pipeline serves a batch (``serving_pipelines``, ``create_batch``), what the
run changes in the pipeline's config (``run_overrides``) and the run's check of the input file (``validate_batch``).

The pipelines are read from their YAML files as plain data, only ``name``, ``output``, ``engine.task``,
``input.max_line_bytes`` and the ``openai_batch`` section (validated alone): the API server imports no DAG
author's code (an output schema's ``module:Class``)."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batch_llm.batch_api.errors import ApiError, not_found
from batch_llm.batch_api.store import BATCH_ID, FILE_ID, BatchStore, check_id, new_id
from batch_llm.batch_api.validate import Validation, check_input, first_line, line_model
from batch_llm.config.input import MAX_LINE_BYTES
from batch_llm.config.openai_batch import OpenAIBatchConfig, parse_section
from batch_llm.host import path_policy

#: The Param a batch's DAG run carries: the batch id (the run id too). Empty: a run that is no batch's.
PARAM = "openai_batch_id"
#: OpenAI's metadata limits: 16 pairs, keys up to 64 characters, values up to 512.
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


@dataclass(frozen=True)
class ServingPipeline:
    """A pipeline that serves batches: its DAG id, its ``openai_batch`` section, where it writes."""

    dag_id: str
    section: OpenAIBatchConfig
    output_path: str                # output.path, a relative one resolved against the YAML's folder
    output_conn_id: str | None
    max_line_bytes: int
    source: str = ""


def read_serving(path: Path) -> ServingPipeline | None:
    """The serving pipeline one YAML file describes; None where it serves no batches; ValueError when its
    ``openai_batch`` section (or the keys it needs) is invalid."""
    data = path_policy.load_yaml(path_policy.read_local_bounded(str(path), path_policy.MAX_PIPELINE_FILE_BYTES)
                                 .decode("utf-8"))
    section = parse_section(data, path.name)
    if section is None:
        return None
    name, output = data.get("name"), data.get("output")
    if not isinstance(name, str) or not isinstance(output, dict) or not isinstance(output.get("path"), str):
        raise ValueError(f"{path.name}: a pipeline serving batches needs name and output.path")
    task = ((data.get("engine") or {}).get("task")) or "generate"
    if problem := section.endpoint_problem(task):
        raise ValueError(f"{path.name}: {problem}")
    out = output["path"]
    if out.startswith(("./", "../")):
        out = str((path.parent / out).resolve())
    max_line = (data.get("input") or {}).get("max_line_bytes") or MAX_LINE_BYTES
    return ServingPipeline(name, section, out, output.get("conn_id"), int(max_line), path.name)


def serving_pipelines(folder: Path) -> tuple[list[ServingPipeline], list[str]]:
    """Every pipeline of ``folder`` that serves batches, and the problems of the files that could not be read
    (skipped). A model name two pipelines claim is served by neither (a problem names both)."""
    found, problems = [], []
    for path in sorted(folder.glob("*.y*ml")) if folder.is_dir() else []:
        try:
            if (p := read_serving(path)) is not None:
                found.append(p)
        except (ValueError, OSError, UnicodeDecodeError) as e:
            problems.append(str(e).splitlines()[0])
        except Exception as e:  # noqa: BLE001 - a YAML error: one file must not hide the others
            problems.append(f"{path.name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    claims: dict[str, list[str]] = {}
    for p in found:
        for m in p.section.models:
            claims.setdefault(m, []).append(p.dag_id)
    twice = {m for m, who in claims.items() if len(who) > 1}
    for m in sorted(twice):
        problems.append(f"model {m!r} is served by {' and '.join(claims[m])}: by neither until one serves it")
    kept = []
    for p in found:
        models = [m for m in p.section.models if m not in twice]
        if models:
            kept.append(p if len(models) == len(p.section.models) else
                        ServingPipeline(p.dag_id, p.section.model_copy(update={"models": models}), p.output_path,
                                        p.output_conn_id, p.max_line_bytes, p.source))
    return kept, problems


def _json_object(line: bytes) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except (ValueError, UnicodeDecodeError):
        return False


def _check_metadata(metadata: Any) -> dict | None:
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_PAIRS or any(
            not isinstance(k, str) or not isinstance(v, str) or len(k) > MAX_METADATA_KEY or len(v) > MAX_METADATA_VALUE
            for k, v in metadata.items()):
        raise ApiError(400, f"Invalid metadata: at most {MAX_METADATA_PAIRS} pairs of strings, keys up to "
                            f"{MAX_METADATA_KEY} characters, values up to {MAX_METADATA_VALUE}.", param="metadata",
                       code="invalid_value")
    return metadata


def _checked_body(body: Any) -> tuple[str, str, str, dict | None]:
    """(input_file_id, endpoint, completion_window, metadata) of a POST /v1/batches body, its keys checked."""
    if not isinstance(body, dict):
        raise ApiError(400, "The body must be a JSON object.")
    unknown = sorted(set(body) - {"input_file_id", "endpoint", "completion_window", "metadata",
                                  "output_expires_after"})
    if unknown:
        raise ApiError(400, f"Unrecognized request argument supplied: {unknown[0]}", param=unknown[0],
                       code="unknown_parameter")
    if body.get("output_expires_after") is not None:
        raise ApiError(400, "output_expires_after is not supported here: output files are kept until deleted "
                            "(DELETE /v1/files/<id>).", param="output_expires_after", code="unsupported_value")
    for key in ("input_file_id", "endpoint", "completion_window"):
        if not isinstance(body.get(key), str) or not body[key]:
            raise ApiError(400, f"Missing required parameter: '{key}'.", param=key, code="missing_required_parameter")
    return body["input_file_id"], body["endpoint"], body["completion_window"], _check_metadata(body.get("metadata"))


def _input_file(store: BatchStore, file_id: str, owner: str) -> dict:
    """The owner's batch input file ``file_id`` (404 for another's: it is not theirs to see)."""
    try:
        meta = store.file(file_id) if FILE_ID.fullmatch(file_id) else None
    except ApiError:
        meta = None
    if meta is None or meta.get("owner") != owner:
        raise not_found("file", file_id, "input_file_id")
    if meta.get("purpose") != "batch":
        raise ApiError(400, f"File {file_id} has purpose {meta.get('purpose')!r}; a batch reads a file of purpose "
                            "'batch'.", param="input_file_id", code="invalid_value")
    return meta


def _serving(pipelines: list[ServingPipeline], model: str | None, endpoint: str, window: str) -> ServingPipeline:
    """The pipeline serving ``model`` at ``endpoint`` within ``window``; 400 as OpenAI says each problem."""
    if model is None:
        raise ApiError(400, "The input file's first request names no model (body.model): a batch is routed to the "
                            "pipeline serving its model.", param="input_file_id", code="invalid_request")
    serving = next((p for p in pipelines if model in p.section.models), None)
    if serving is None:
        served = sorted(m for p in pipelines for m in p.section.models)
        raise ApiError(400, f"The model {model!r} does not exist here (served: {', '.join(served) or 'none'}).",
                       param="model", code="model_not_found")
    if endpoint not in serving.section.endpoints:
        raise ApiError(400, f"Invalid endpoint {endpoint!r} for model {model!r}: it serves "
                            f"{', '.join(serving.section.endpoints)}.", param="endpoint", code="invalid_value")
    if window not in serving.section.completion_windows:
        raise ApiError(400, f"Invalid completion_window {window!r}: {', '.join(serving.section.completion_windows)} "
                            f"for model {model!r}.", param="completion_window", code="invalid_value")
    return serving


def create_batch(store: BatchStore, pipelines: list[ServingPipeline], *, owner: str,
                 body: dict) -> tuple[dict, ServingPipeline]:
    """The batch record of a POST /v1/batches body, written to the store, and the pipeline that serves it (the
    one whose ``openai_batch.models`` names the model of the file's first line); ApiError (400, 404) for what
    OpenAI refuses: an unknown file, endpoint or model, a window not offered."""
    file_id, endpoint, window, metadata = _checked_body(body)
    meta = _input_file(store, file_id, owner)
    endpoints = sorted({e for p in pipelines for e in p.section.endpoints})
    if endpoint not in endpoints:
        raise ApiError(400, f"Invalid endpoint {endpoint!r}: this deployment serves "
                            f"{', '.join(endpoints) or 'no endpoint (no pipeline has an openai_batch section)'}.",
                       param="endpoint", code="invalid_value")
    with store.open_content(file_id) as f:
        first = first_line(f, max((p.max_line_bytes for p in pipelines), default=MAX_LINE_BYTES))
    if first is not None and not _json_object(first):
        raise ApiError(400, "The input file is not JSONL: its first line is not a JSON object.",
                       param="input_file_id", code="invalid_json_line")
    serving = _serving(pipelines, line_model(first) if first is not None else None, endpoint, window)
    record = {"id": new_id("batch_"), "object": "batch", "endpoint": endpoint, "input_file_id": file_id,
              "completion_window": window, "created_at": int(time.time()), "metadata": metadata,
              "model": line_model(first) if first is not None else None,
              "pipeline": serving.dag_id, "owner": owner, "input_bytes": meta["bytes"]}
    return store.create_batch(record), serving


def request_cancel(store: BatchStore, batch_id: str) -> dict:
    """Records the cancel (once: the first one's time is the batch's ``cancelling_at``)."""
    store.batch(batch_id)
    return store.write_note(batch_id, "cancel", {"cancelling_at": int(time.time())}, once=True)


def batch_of_run(store: BatchStore, batch_id: str, dag_id: str) -> dict:
    """The record of the batch a run serves; ValueError when the id names no batch of this pipeline (a hand-made
    run cannot point a pipeline at another pipeline's batch)."""
    try:
        record = store.batch(check_id(BATCH_ID, batch_id, "batch"))
    except ApiError as e:
        raise ValueError(f"params: {PARAM} {batch_id!r}: {e.message}") from None
    if record["pipeline"] != dag_id:
        raise ValueError(f"params: {PARAM} {batch_id!r} is a batch of pipeline {record['pipeline']!r}, not {dag_id!r}")
    return record


def run_overrides(store: BatchStore, record: dict) -> dict[str, Any]:
    """The dotted config keys a batch's run sets: its input file (OpenAI Batch lines, the batch's endpoint the only
    url a line may name) and a partition of its own (the batch id), so each batch publishes its own version."""
    return {"input.path": store.file_dir(record["input_file_id"]).child("content").url,
            "input.format": "openai_batch", "input.openai_urls": [record["endpoint"]],
            "output.partition": record["id"]}


def validate_batch(store: BatchStore, record: dict, section: OpenAIBatchConfig, max_line_bytes: int) -> Validation:
    """The batch's input file checked (``validate.check_input``) and the result noted for the status."""
    fid = record["input_file_id"]

    def open_file():
        try:
            store.file(fid)
        except ApiError:
            raise FileNotFoundError(fid) from None
        return store.content_path(fid).open("rb")

    v = check_input(open_file, expected_bytes=record.get("input_bytes"), model=record["model"], section=section,
                    max_line_bytes=max_line_bytes)
    store.write_note(record["id"], "validation", v.to_dict())
    return v
