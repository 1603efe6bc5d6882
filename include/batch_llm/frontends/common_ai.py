"""A batch of prompts in the conventions of Airflow's common-ai provider, run by this project's stages.

``apache-airflow-providers-common-ai`` (1.0.0) sends a batch to a hosted batch API with ``LLMBatchOperator`` /
``@task.llm_batch`` and lands it in a fixed shape; this module lands a self-hosted batch in the same shape, so a
task can move between the two. What is the same (names and values from common-ai 1.0.0's
``batch/results.py``, ``batch/state.py`` and ``batch/output_schema.py``):

- **Requests**: a list of prompt strings or of ``{"prompt", "system_prompt", "max_tokens", "params"}`` objects
  (``BatchRequest``); a batch-level ``system_prompt`` and ``max_tokens`` apply where a request sets none, and
  ``request_params`` are merged into every request (the request's own ``params`` win).
- **Identity**: ``identity_key`` is common-ai's run-stable key (dag id, task id, run id, map index; never the try
  number), so the result file is ``<result_path>/<key16>.jsonl`` and the custom ids ``<key16>-<index>``, the
  names common-ai gives them for the same task instance.
- **Rows** (``ResultRow``): ``custom_id, index, status, output, raw_output, error, model, usage, finish_reason``
  with ``status`` one of ``success``, ``error``, ``invalid_output``, ``missing``; an output that does not match
  ``output_type`` is an ``invalid_output`` row with the text in ``raw_output``, never a failed task.
- **Manifest** (``LLMBatchManifest``, the XCom value): the same keys, ``schema_version`` 1 and the same outcome
  buckets (``succeeded, errored, invalid_output, expired, cancelled, missing``, summing to ``request_count``).

What differs, and why:

- The model answers on this project's engines (vLLM, LMDeploy, transformers), sharded by the planner, so the
  batch is this project's stages: ``prepare`` (requests → an OpenAI Batch file, the planner's drop-in input),
  ``stages.plan_shards``, ``stages.infer_shard`` per shard, then ``land`` here. ``output_type`` becomes
  ``sampling.output_schema`` (vLLM decodes under it); every output is then validated with pydantic, as
  common-ai does.
- Outputs are checked against ``output_type``'s own JSON Schema; common-ai wraps a non-object root (``int``,
  ``list[str]``) as ``{"response": ...}`` because hosted APIs need an object, vLLM does not. ``output`` is the
  unwrapped value either way.
- Errors carry common-ai's class names and bases (``LLMBatchInputError``, ``LLMBatchPartialFailureError``, ...);
  a request the engine failed is ``provider_error`` / ``stage: provider``, common-ai's for a failed request.
- No ``expired`` / ``cancelled`` rows (there is no provider deadline); the buckets are there, at 0.
- Rows are written in index order (``ordered: true``); common-ai writes them as the provider streams them.
- State: where common-ai keeps one JSON file per task instance under ``_airflow_batch_state/``, a batch here keeps
  a run folder ``<result_path>/_batch_llm_state/<key16>/runs/batch/<fingerprint>/`` named by what decides the
  outputs (the requests and the config). A retry or clear with the same input finds that folder and re-attaches:
  the plan is not redone, committed shards are not run again, a shard stopped mid-way resumes after its last
  committed chunk, a landed result is returned as is. Changed input is a new folder: a fresh batch.

    out = OutputType.of(Sentiment)
    batch = prepare(cfg, state_root, key=identity_key(...), requests=normalize_requests(prompts), ...)
    plan = stages.plan_shards(batch.config, batch.layout)            # then infer_shard per shard
    manifest = land(batch.config, batch.layout, batch.manifest, out, result=..., result_uri=...)
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import heapq
import json
import re
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from batch_llm.config import ConfigError, PipelineConfig, apply_overrides, parse_config
from batch_llm.config.capabilities import DEFAULT_KIND, serving
from batch_llm.config.input import MAX_LINE_BYTES
from batch_llm.io.formats import Lines, read_rows
from batch_llm.io.storage import Location, atomic_writer, exists, iter_jsonl, json_bytes, read_json, write_json, write_jsonl
from batch_llm.layout import RunLayout
from batch_llm.manifests import Manifest, PlanManifest
from batch_llm.output_schema import INVALID_OUTPUT, check_schema
from batch_llm.rows.params import openai_response_format

SCHEMA_VERSION: Final = 1     # common-ai's manifest "schema_version"
STATE_DIR = "_batch_llm_state"
ADAPTER = "batch_llm"         # the manifest's "adapter" (common-ai: "openai", "anthropic")
ERROR_MESSAGE_MAX_LENGTH = 2000  # common-ai truncates validation messages to this

# Row statuses and manifest buckets (common-ai batch/results.py). A row status -> its bucket in "counts".
STATUS_BUCKET = {"success": "succeeded", "error": "errored", "invalid_output": "invalid_output",
                 "expired": "expired", "cancelled": "cancelled", "missing": "missing"}
RowStatus = Literal["success", "error", "invalid_output", "expired", "cancelled", "missing"]

# Request body keys: the sampling parameters the engines apply per request (rows/params.py checks each engine),
# metadata that changes nothing (dropped), and keys the batch manages itself (dropped: the request's prompt,
# system prompt, token cap and output_type decide them, as common-ai's adapters do).
SAMPLING_PARAMS = ("temperature", "top_p", "stop", "seed", "presence_penalty", "frequency_penalty")
METADATA_PARAMS = ("user", "metadata")
MANAGED_PARAMS = ("model", "messages", "max_tokens", "max_completion_tokens", "response_format")


# Errors: common-ai's names and bases (``airflow.providers.common.ai.exceptions``, 1.0.0) where the meaning is the
# same. They are plain exceptions, so Airflow retries them by the task's ``retries``, as it does common-ai's. The
# Airflow layer (``batch_llm_airflow.llm_batch``) raises subclasses that are also common-ai's own classes when that
# provider is installed, so ``except LLMBatchPartialFailureError`` catches either provider's.
class LLMBatchInputError(ValueError):
    """The batch as a whole cannot run (not a list, an empty list, a parameter no engine applies): fix the task.
    common-ai: "errors detected before a batch is submitted"."""


class LLMBatchModelMismatchError(LLMBatchInputError):
    """A request's ``model`` is not the batch's ``model_id`` (one model serves a batch, as on OpenAI's)."""


class UnsupportedBatchProviderError(LLMBatchInputError):
    """``model_id`` names a hosted model (``"<provider>:<model>"``): nothing here serves it."""


class LLMBatchOutputTypeError(LLMBatchInputError):
    """``output_type`` (or ``request_params["response_format"]``) gives no JSON Schema."""


class LLMBatchJobError(RuntimeError):
    """The batch ran, and something after planning failed (a shard that never committed, counts that do not
    reconcile). common-ai: "errors detected after a batch is submitted"."""


class LLMBatchPartialFailureError(LLMBatchJobError):
    """``fail_on_partial_error=True`` and a request has no valid result (the manifest's ``counts`` say which).
    Retryable, as common-ai's: the landed results stay, a retry lands the same ones and raises again."""


class LLMBatchStateReadError(LLMBatchJobError):
    """The batch's state (its prepared run folder) exists but cannot be read: retryable, as common-ai's."""


# Parents first: the Airflow layer builds its common-ai subclasses in this order.
COMMON_AI_ERRORS = (LLMBatchInputError, LLMBatchModelMismatchError, UnsupportedBatchProviderError,
                    LLMBatchOutputTypeError, LLMBatchJobError, LLMBatchPartialFailureError, LLMBatchStateReadError)


# ------------------------------------------------------------------------------------------ requests
class BatchRequest(BaseModel):
    """One request, as common-ai's ``BatchRequest``: a bare string ``"foo"`` means ``{"prompt": "foo"}``."""

    model_config = ConfigDict(extra="forbid")

    prompt: str
    model: str | None = Field(None, description="must be the batch's model_id: one model serves a batch")
    system_prompt: str | None = None
    max_tokens: int | None = Field(None, gt=0)
    params: dict[str, Any] = Field(default_factory=dict)


def normalize_requests(requests: Any) -> list[BatchRequest]:
    """A list of strings or request objects as ``BatchRequest``s; ``LLMBatchInputError`` names the bad item.

    A bare string is refused rather than iterated (a decorated function returning ``"summarize this"``
    would otherwise be one request per character), as common-ai refuses it."""
    if isinstance(requests, (str, bytes, Mapping)) or not isinstance(requests, Sequence):
        raise LLMBatchInputError(f"requests must be a list of prompt strings or of {{'prompt': ...}} objects, got "
                              f"{type(requests).__name__}; a decorated function must return the whole list")
    out = []
    for i, item in enumerate(requests):
        try:
            out.append(BatchRequest(prompt=item) if isinstance(item, str) else BatchRequest.model_validate(item))
        except ValidationError as e:
            raise LLMBatchInputError(f"request {i}: {_first_error(e)}") from None
    if not out:
        raise LLMBatchInputError("a batch needs at least one request; got an empty list")
    return out


def requests_from_file(input_path: Location, fmt: str = "auto") -> Iterator[BatchRequest | str]:
    """The requests of a JSONL / Parquet / CSV file or folder, one per row, streamed: a row has ``prompt`` and
    optionally ``system_prompt``, ``max_tokens``, ``params`` (CSV: JSON text); other columns are left alone.
    A row that is not a request yields the reason (a string): it lands as an ``error`` row."""
    fields = set(BatchRequest.model_fields)
    for raw in read_rows(input_path.path(), fmt, Lines(MAX_LINE_BYTES)):
        where = f"{raw.source} line {raw.line}"
        if raw.error:
            yield f"{where}: {raw.error}"
            continue
        rec = {k: v for k, v in (raw.record or {}).items() if k in fields and v not in (None, "")}
        if isinstance(rec.get("params"), str):
            try:
                rec["params"] = json.loads(rec["params"])
            except json.JSONDecodeError:
                yield f"{where}: params is text but not JSON"
                continue
        try:
            yield BatchRequest.model_validate(rec)
        except ValidationError as e:
            yield f"{where}: {_first_error(e)}"


def _first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or "(the request)"
    return f"{where}: {err['msg']}"


def identity_key(*, dag_id: str, task_id: str, run_id: str, map_index: int = -1) -> str:
    r"""common-ai's run-stable identity of a task instance (``batch/state.py: compute_identity_key``): sha256 of
    the ``\x00``-joined ids, without the try number, so every attempt and every clear finds the same state."""
    return hashlib.sha256("\x00".join([dag_id, task_id, run_id, str(map_index)]).encode()).hexdigest()


def request_params_problem(params: Mapping[str, Any]) -> str | None:
    """Why these request parameters cannot be honored here, or None (managed and metadata keys are dropped)."""
    unknown = sorted(set(params) - set(SAMPLING_PARAMS) - set(METADATA_PARAMS) - set(MANAGED_PARAMS))
    if not unknown:
        return None
    return (f"params {', '.join(map(repr, unknown))}: not a sampling parameter a self-hosted engine applies "
            f"(it applies {', '.join(SAMPLING_PARAMS)})")


def response_format_schema(response_format: Any) -> dict | None:
    """The JSON Schema an OpenAI ``response_format`` asks for, or None for plain text: ``{"type": "json_schema",
    "json_schema": {"schema": {...}}}`` its schema (``name`` and ``strict`` are the API's own), ``{"type":
    "json_object"}`` any object, ``{"type": "text"}`` (or none) plain text. It becomes ``sampling.output_schema``:
    vLLM decodes under it, the other engines check every output against it (``invalid_output`` rows)."""
    if response_format is None:
        return None
    kind, schema = openai_response_format(response_format)
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if not isinstance(schema, Mapping):
        raise LLMBatchOutputTypeError(
            f"response_format {response_format!r}: expected {{'type': 'json_schema', 'json_schema': {{'schema': "
            "{...}}}}, {'type': 'json_object'} or {'type': 'text'}")
    try:
        return check_schema(dict(schema))
    except ValueError as e:
        raise LLMBatchOutputTypeError(f"response_format: not a JSON Schema ({e})") from None


def request_line(req: BatchRequest, index: int, *, prefix: str, system_prompt: str, max_tokens: int,
                 request_params: Mapping[str, Any]) -> dict:
    """One request as an OpenAI Batch line (the planner's drop-in input): the batch's system prompt and token
    cap where the request sets none, ``request_params`` under the request's own ``params``."""
    params = {k: v for k, v in {**request_params, **req.params}.items()
              if k not in MANAGED_PARAMS and k not in METADATA_PARAMS}
    messages = [{"role": "user", "content": req.prompt}]
    if req.system_prompt or system_prompt:
        messages.insert(0, {"role": "system", "content": req.system_prompt or system_prompt})
    return {"custom_id": f"{prefix}-{index}", "method": "POST", "url": "/v1/chat/completions",
            "body": {**params, "messages": messages, "max_tokens": req.max_tokens or max_tokens}}


def index_of(custom_id: Any) -> int:
    """The request index in a ``<key16>-<index>`` custom id; -1 (out of range) for anything else."""
    _, _, tail = str(custom_id).rpartition("-")
    return int(tail) if tail.isdigit() else -1


# ------------------------------------------------------------------------------------------ output_type
@dataclass(frozen=True)
class OutputType:
    """``output_type`` as common-ai reads it: ``str`` is plain text (not validated), anything else pydantic's
    ``TypeAdapter`` takes (a ``BaseModel`` subclass, ``int``, ``list[str]`` ...) is structured output: its JSON
    Schema goes to the engine and every answer is validated against the type."""

    type: Any
    adapter: TypeAdapter | None

    @classmethod
    def of(cls, output_type: Any = str) -> "OutputType":
        if output_type is str:
            return cls(str, None)
        try:
            adapter = TypeAdapter(output_type)
            adapter.json_schema()
        except Exception as e:  # noqa: BLE001 - pydantic raises several kinds; the message says which
            raise LLMBatchOutputTypeError(f"output_type={output_type!r} has no JSON Schema ({e}); use a pydantic "
                                  "BaseModel subclass or a type TypeAdapter supports (int, list[str], ...)") from None
        return cls(output_type, adapter)

    @property
    def structured(self) -> bool:
        return self.adapter is not None

    @property
    def json_schema(self) -> dict | None:
        if self.adapter is None:
            return None
        model_schema = getattr(self.type, "model_json_schema", None)  # a BaseModel: its own schema, as common-ai
        return check_schema(model_schema() if callable(model_schema) else self.adapter.json_schema())

    @property
    def ref(self) -> str | None:
        """``module.QualName`` (the manifest's ``output_type_ref``); None for ``str``."""
        if self.adapter is None:
            return None
        module, name = getattr(self.type, "__module__", None), getattr(self.type, "__qualname__", None)
        return f"{module}.{name}" if module and name else str(self.type)

    def validate(self, text: str | None) -> tuple[Any, str | None]:
        """(the value, None) for a usable answer, JSON-native (``mode="json"``); (None, the reason) otherwise."""
        if text is None:
            return None, "the model returned no text"
        if self.adapter is None:
            return text, None
        try:
            value = self.adapter.validate_python(json.loads(text))
        except json.JSONDecodeError as e:
            return None, f"not JSON ({e.msg} at character {e.pos})"
        except ValidationError as e:
            return None, _truncate(str(e))
        return self.adapter.dump_python(value, mode="json"), None


def _truncate(message: str) -> str:
    return message if len(message) <= ERROR_MESSAGE_MAX_LENGTH else message[:ERROR_MESSAGE_MAX_LENGTH] + "… (truncated)"


# ------------------------------------------------------------------------------------------ the config
def batch_config(*, name: str, model_id: str, result_path: str, max_tokens: int, output: OutputType,
                 base: PipelineConfig | None = None, overrides: Mapping[str, Any] | None = None,
                 response_format: Any = None) -> PipelineConfig:
    """The pipeline config of a batch: ``base`` (or the defaults) with the batch's model, token cap and output
    schema, the filter and scoring off (a batch lands raw results), then ``overrides`` (dotted keys); an override
    that turns the filter on is refused (``land`` would publish what it was to mask).

    The output schema is ``output``'s; with ``output_type=str``, ``response_format`` (``request_params``' own,
    OpenAI's shape) gives it (``response_format_schema``). A structured ``output_type`` wins over a
    ``response_format``, as common-ai's adapters put its directive after the request parameters.

    Two defaults differ from a pipeline's, for common-ai's meaning: ``engine.max_error_rate`` is 1.0 (failed
    rows are outcomes in the manifest; ``fail_on_partial_error`` decides), and ``sampling.guided_decoding``
    follows the engine (vLLM decodes under the schema; the others only check, as they cannot guide)."""
    if re.match(r"^[A-Za-z][\w.+-]*:(?!//)", model_id):
        raise UnsupportedBatchProviderError(f"model_id {model_id!r} names a hosted model ('<provider>:<model>'); the GPU batch "
                              "loads a checkpoint: a ModelScope id, a local folder or an object-storage prefix")
    data = base.model_dump(mode="json") if base is not None else {}
    # The batch's own input (its requests) and output (result_path): nothing of a base pipeline's input section
    # (a template, a system prompt) may reach the requests.
    data.update(name=re.sub(r"[^A-Za-z0-9_.-]", "_", name), model={**data.get("model", {}), "ref": model_id},
                input={"path": "(written by the batch)", "format": "openai_batch"}, output={"path": result_path})
    data.setdefault("filter", {})["enabled"] = False
    data.setdefault("evaluate", {})["enabled"] = False
    engine = data.setdefault("engine", {})
    if base is None or "max_error_rate" not in base.engine.model_fields_set:
        engine["max_error_rate"] = 1.0
    overrides = dict(overrides or {})
    kind = overrides.get("engine.kind", engine.get("kind", DEFAULT_KIND))
    schema = output.json_schema if output.structured else response_format_schema(response_format)
    data["sampling"] = {**data.get("sampling", {}), "max_tokens": max_tokens, "output_schema": schema}
    if "sampling.guided_decoding" not in overrides and schema is not None:
        data["sampling"]["guided_decoding"] = kind in serving("guided_decoding")
    # validated once, with the overrides in
    where = f"batch {name!r} (with its config_overrides)" if overrides else f"batch {name!r}"
    cfg = parse_config(apply_overrides(data, overrides), where)
    if cfg.filter.enabled:  # land() writes the shards' results: a filter (and its masks) set here would never run
        raise ConfigError(f"{where}: filter.enabled: a batch lands the model's results as they are, with no content "
                          "filter or review; run a pipeline (batch-llm run, the pipeline DAGs) to filter outputs")
    return cfg


def _fingerprint_config(cfg: PipelineConfig) -> bytes:
    """What in the config decides the outputs: not the paths (they name the state) nor the Airflow routing."""
    return json_bytes(cfg.model_dump(mode="json", exclude={"name": True, "airflow": True, "input": {"path"},
                                                           "output": {"path", "conn_id"}}))


# ------------------------------------------------------------------------------------------ prepare
class PreparedBatch(Manifest):
    """The batch's state, written last by ``prepare`` under ``<run>/batch/``: a retry that finds it re-attaches."""

    stage: Literal["batch"] = "batch"
    key16: str
    fingerprint: str
    request_count: int
    requests: str          # requests.jsonl: the OpenAI Batch lines the planner reads
    refused: str           # refused.jsonl: {index, reason} of requests refused before planning
    refused_count: int
    config: str            # config.json: the batch's pipeline config (every later task reads it)
    submitted_at: str


@dataclass(frozen=True)
class Batch:
    """A prepared batch: its config, its run layout (the plan, shards and landing go there) and its state."""

    config: PipelineConfig
    layout: RunLayout
    manifest: PreparedBatch
    reattached: bool


def batch_layout(state_root: Location, key16: str, fingerprint: str) -> RunLayout:
    """``<state_root>/<key16>/runs/batch/<fingerprint>/`` as a ``RunLayout`` (the shard worker rebuilds it)."""
    layout = RunLayout(output_root=state_root, pipeline=key16, partition="batch", run_id=fingerprint,
                       input=state_root)
    return dataclasses.replace(layout, input=layout.stage("batch").child("requests.jsonl"))


def read_batch(state_root: Location, key16: str, fingerprint: str) -> Batch:
    """A batch ``prepare`` committed (what the tasks after it run on)."""
    layout = batch_layout(state_root, key16, fingerprint)
    try:
        manifest = PreparedBatch.read(layout.stage("batch").path())
        cfg = parse_config(read_json(Location(manifest.config, state_root.options).path()), manifest.config)
    except (OSError, ValueError) as e:  # missing, unreadable or not what prepare wrote
        raise LLMBatchStateReadError(f"cannot read the batch's state in {layout.stage('batch').url}: {e}") from e
    return Batch(cfg, layout, manifest, reattached=True)


def prepare(cfg: PipelineConfig, state_root: Location, *, key: str, requests: Iterable[BatchRequest | str],
            system_prompt: str = "", request_params: Mapping[str, Any] | None = None) -> Batch:
    """Writes the requests as OpenAI Batch lines (and refused ones with their reason) into the run folder their
    fingerprint names, then the config and the state; returns the batch, or the one a previous attempt left there.

    Streamed: requests go to a local file while they are hashed (the fingerprint names the folder), then up."""
    request_params = dict(request_params or {})
    if why := request_params_problem(request_params):
        raise LLMBatchInputError(f"request_params: {why}")
    key16 = key[:16]
    with tempfile.TemporaryDirectory(prefix="batch_llm_requests_") as tmp:
        lines, refused = Path(tmp, "requests.jsonl"), Path(tmp, "refused.jsonl")
        digest = hashlib.sha256(_fingerprint_config(cfg))
        n = n_refused = 0
        schema = cfg.sampling.output_schema
        with open(lines, "wb") as ok, open(refused, "wb") as bad:
            for i, req in enumerate(requests):
                n += 1
                why = req if isinstance(req, str) else request_problem(req, cfg.model.ref, schema)
                if isinstance(req, BatchRequest) and not why:
                    line = json_bytes(request_line(req, i, prefix=key16, system_prompt=system_prompt,
                                                   max_tokens=cfg.sampling.max_tokens,
                                                   request_params=request_params)) + b"\n"
                    ok.write(line)
                else:
                    line = json_bytes({"index": i, "reason": why}) + b"\n"
                    bad.write(line)
                    n_refused += 1
                digest.update(line)
        if n == 0:
            raise LLMBatchInputError("a batch needs at least one request; the input has none")
        fingerprint = digest.hexdigest()[:16]
        layout = batch_layout(state_root, key16, fingerprint)
        state = layout.stage("batch")
        if exists(state.child("manifest.json").path()):  # an earlier attempt prepared this very input
            return read_batch(state_root, key16, fingerprint)
        cfg = cfg.with_overrides({"input.path": layout.input.url, "input.format": "openai_batch"},
                                 source=f"batch {cfg.name!r}")
        for src, name in ((lines, "requests.jsonl"), (refused, "refused.jsonl")):
            with open(src, "rb") as fh, atomic_writer(state.child(name).path()) as w:
                shutil.copyfileobj(fh, w)
    write_json(state.child("config.json").path(), cfg.model_dump(mode="json"))
    manifest = PreparedBatch(key16=key16, fingerprint=fingerprint, request_count=n, requests=layout.input.url,
                             refused=state.child("refused.jsonl").url, refused_count=n_refused,
                             config=state.child("config.json").url,
                             submitted_at=dt.datetime.now(dt.timezone.utc).isoformat())
    manifest.write(state.path())
    return Batch(cfg, layout, manifest, reattached=False)


def request_problem(req: BatchRequest, model_id: str, schema: dict | None = None) -> str | None:
    if req.model is not None and req.model != model_id:
        raise LLMBatchModelMismatchError(f"a request sets model={req.model!r}; one model serves a batch here "
                                         f"({model_id!r}), as on OpenAI's batch API")
    if "response_format" in req.params:  # one schema decodes a batch: a request may only repeat it
        try:
            own = response_format_schema(req.params["response_format"])
        except LLMBatchInputError as e:
            return f"params {e}"
        if own != schema:
            return ("params 'response_format' asks for another schema than the batch's; one schema serves a batch "
                    "here: give it as request_params['response_format'] or output_type")
    return request_params_problem(req.params)


# ------------------------------------------------------------------------------------------ land
class RowError(BaseModel):
    """common-ai's row ``error``: ``type`` and ``stage`` say what failed where."""

    type: str
    message: str | None
    provider_code: str | None = None
    stage: str


class Usage(BaseModel):
    input_tokens: int
    output_tokens: int


class ResultRow(BaseModel):
    """One line of the result file, common-ai's row shape (``batch/results.py``)."""

    custom_id: str
    index: int
    status: RowStatus
    output: Any = None
    raw_output: str | None = None
    error: RowError | None = None
    model: str | None = None
    usage: Usage | None = None
    finish_reason: str | None = None


class _ShardRow(BaseModel):
    """What a shard committed for one request (``stages.infer.results``' result and error rows)."""

    model_config = ConfigDict(extra="ignore")

    id: str
    output: str | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    error_kind: str | None = None


class _Refused(BaseModel):
    model_config = ConfigDict(extra="ignore")

    index: int | None = None
    id: str | int | None = None
    reason: str


class LLMBatchCounts(BaseModel):
    """common-ai's outcome buckets: every request in exactly one."""

    succeeded: int = 0
    errored: int = 0
    invalid_output: int = 0
    expired: int = 0
    cancelled: int = 0
    missing: int = 0

    def total(self) -> int:
        return sum(self.model_dump().values())


class GpuBatchDetails(BaseModel):
    """The one key common-ai's manifest does not have: where and on what the batch ran."""

    engine: str
    shards: int
    run_dir: str
    reattached: bool


class LLMBatchManifest(Manifest):
    """The XCom value: common-ai's manifest keys and values (``assemble_manifest``), plus ``batch_llm``."""

    schema_version: Literal[1] = SCHEMA_VERSION
    batch_id: str
    adapter: str = ADAPTER
    llm_conn_id: str | None = None      # no API connection: the model runs on this project's engines
    model_id: str
    output_type_ref: str | None
    structured: bool
    result_uri: str
    request_count: int
    counts: LLMBatchCounts
    duplicate_result_count: int = 0
    out_of_range_result_count: int = 0
    ordered: bool = True
    rejoin_key: Literal["index"] = "index"
    custom_id_prefix: str
    terminal_reason: Literal["succeeded", "partial", "expired", "cancelled"]
    submitted_at: str
    completed_at: str
    batch_llm: GpuBatchDetails

    def partial_buckets(self) -> dict[str, int]:
        """The buckets of requests without a usable result, where not 0 (``fail_on_partial_error``)."""
        c = self.counts.model_dump()
        return {k: c[k] for k in ("errored", "invalid_output", "expired", "cancelled", "missing") if c[k]}


def _row(index: int, prefix: str, status: RowStatus, **fields: Any) -> ResultRow:
    return ResultRow(custom_id=f"{prefix}-{index}", index=index, status=status, **fields)


def _inference_row(r: _ShardRow, index: int, prefix: str, output: OutputType, model: str) -> ResultRow:
    usage = Usage(input_tokens=r.prompt_tokens, output_tokens=r.completion_tokens)
    common = dict(model=model, usage=usage, finish_reason=r.finish_reason)
    if r.error and r.error_kind != INVALID_OUTPUT:
        # common-ai's type and stage for a request the model backend failed ("provider_error", "provider")
        return _row(index, prefix, "error", error=RowError(type="provider_error", message=r.error, stage="provider"),
                    **common)
    value, reason = (None, r.error.removeprefix(f"{INVALID_OUTPUT}: ")) if r.error else output.validate(r.output)
    if reason is None:
        return _row(index, prefix, "success", output=value, **common)
    return _row(index, prefix, "invalid_output", raw_output=r.output, error=RowError(
        type="output_validation_error", message=reason, stage="output_validation"), **common)


def _refused_rows(path: Location, prefix: str, stage: str) -> Iterator[tuple[int, ResultRow]]:
    """Requests refused before inference: by ``prepare`` (``{index, reason}``) or by the planner (its errors file:
    ``{id: <custom id>, reason}``)."""
    for rec in iter_jsonl(path.path()):
        e = _Refused.model_validate(rec)
        index = e.index if e.index is not None else index_of(e.id)
        yield index, _row(index, prefix, "error", error=RowError(type="invalid_request", message=e.reason, stage=stage))


def _shard_rows(path: Location, prefix: str, output: OutputType, model: str) -> Iterator[tuple[int, ResultRow]]:
    for rec in iter_jsonl(path.path()):
        r = _ShardRow.model_validate(rec)
        index = index_of(r.id)
        yield index, _inference_row(r, index, prefix, output, model)


class _Merged:
    """The result rows in index order, counted as they pass: one per request (a repeat is dropped and counted,
    as an index past the batch is), a request no source answered is a ``missing`` row."""

    def __init__(self, request_count: int, prefix: str):
        self.request_count, self.prefix = request_count, prefix
        self.counts = dict.fromkeys(LLMBatchCounts.model_fields, 0)
        self.duplicates = self.out_of_range = 0

    def rows(self, indexed: Iterable[tuple[int, ResultRow]]) -> Iterator[dict]:
        expected = 0
        for index, row in indexed:
            if not 0 <= index < self.request_count:
                self.out_of_range += 1
            elif index < expected:
                self.duplicates += 1
            else:
                yield from self._missing(expected, index)
                yield self._counted(row)
                expected = index + 1
        yield from self._missing(expected, self.request_count)

    def _missing(self, start: int, stop: int) -> Iterator[dict]:
        for gap in range(start, stop):
            yield self._counted(_row(gap, self.prefix, "missing"))

    def _counted(self, row: ResultRow) -> dict:
        self.counts[STATUS_BUCKET[row.status]] += 1
        return row.model_dump(mode="json")


def land(cfg: PipelineConfig, layout: RunLayout, batch: PreparedBatch, output: OutputType, *, result: Location,
         result_uri: str, reattached: bool = False) -> LLMBatchManifest:
    """Writes ``result`` (every request once, in index order) from the refused requests, the planner's errors and
    every shard's outputs and errors, streamed (a k-way merge by index: each source is in index order), and
    returns the manifest; one a previous attempt committed is returned as is while its result file exists."""
    land_dir = layout.stage("land")
    if (done := LLMBatchManifest.read_if_done(land_dir.path())) and exists(result.path()):
        return done
    plan = PlanManifest.read(layout.stage("plan").path())
    opts, prefix, model = layout.output_root.options, batch.key16, cfg.model.ref
    sources = [_refused_rows(Location(batch.refused, opts), prefix, "prepare"),
               _refused_rows(Location(plan.errors, opts), prefix, "plan")]
    for s in plan.shards:
        shard_dir = layout.shard_dir(s.index)
        if not exists(shard_dir.child("manifest.json").path()):
            raise LLMBatchJobError(f"shard {s.index} has not committed (no manifest in {shard_dir.url}); "
                               "run its batch_inference task first")
        for name in ("outputs.jsonl", "errors.jsonl"):
            sources.append(_shard_rows(shard_dir.child(name), prefix, output, model))
    merged = _Merged(batch.request_count, prefix)
    write_jsonl(result.path(), merged.rows(heapq.merge(*sources, key=lambda x: x[0])))
    c = LLMBatchCounts(**merged.counts)
    if c.total() != batch.request_count:  # every request in exactly one bucket, as common-ai checks
        raise LLMBatchJobError(f"result counts ({c.total()}) do not reconcile with request_count "
                           f"({batch.request_count}): {c.model_dump()}")
    manifest = LLMBatchManifest(
        batch_id=f"{prefix}-{batch.fingerprint}", model_id=model, output_type_ref=output.ref,
        structured=output.structured, result_uri=result_uri, request_count=batch.request_count, counts=c,
        duplicate_result_count=merged.duplicates, out_of_range_result_count=merged.out_of_range, custom_id_prefix=prefix,
        terminal_reason="succeeded" if c.succeeded == batch.request_count else "partial",
        submitted_at=batch.submitted_at, completed_at=dt.datetime.now(dt.timezone.utc).isoformat(),
        batch_llm=GpuBatchDetails(engine=cfg.engine.kind, shards=len(plan.shards), run_dir=layout.run_dir.url,
                                  reattached=reattached))
    manifest.write(land_dir.path())
    return manifest
