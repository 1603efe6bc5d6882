"""A result row → the published output record: the input's columns plus the generated ones (JSONL, Parquet,
CSV), or an OpenAI Batch output / error line for OpenAI Batch input; and the columns a record's generated values
are named by."""
from __future__ import annotations

import base64
import hashlib
import json
import time
from collections.abc import Iterator

from batch_llm.output_schema import OutputSchema, column_value
from batch_llm.rows.openai_batch import (
    ErrorBody,
    ErrorDetail,
    ErrorLine,
    ErrorResponse,
    OutputLine,
    OutputResponse,
    line_dict,
)


def joined_outputs(records: Iterator[dict], outputs: Iterator[dict]) -> Iterator[tuple[dict, dict]]:
    """(input record, output row) pairs by position: both streams are in input order (``idx`` ascending);
    a record without an output (an error, a dropped row) is skipped."""
    out = next(outputs, None)
    for rec in records:
        while out is not None and out["idx"] < rec["idx"]:
            out = next(outputs, None)
        if out is None:
            return
        if out["idx"] == rec["idx"]:
            yield rec, out


def output_record(record: dict, result: dict, fmt: str, *, model: str = "", schema: OutputSchema | None = None,
                  run_id: str = "") -> dict:
    """The published row: the input's columns plus the generated ones (OpenAI Batch output lines, as OpenAI
    documents them, for OpenAI Batch input; ``model`` names the model that served them, ``run_id`` the run whose
    line ids they are: ``openai_line_ids``)."""
    if fmt == "openai_batch":
        where = f"row {result['idx']}"
        if result.get("error"):
            return openai_error_line(record.get("custom_id"), result["error"], code="row_error", run_id=run_id,
                                     where=where)
        line_id, request_id = openai_line_ids(run_id, where)
        if record.get("url") == "/v1/embeddings":
            body = embedding_body(result, model, (record.get("body") or {}).get("encoding_format"))
            return line_dict(OutputLine(id=line_id, custom_id=record.get("custom_id"),
                                        response=OutputResponse(status_code=200, request_id=request_id, body=body)))
        usage = {"prompt_tokens": result.get("prompt_tokens", 0),
                 "completion_tokens": result.get("completion_tokens", 0),
                 "total_tokens": result.get("prompt_tokens", 0) + result.get("completion_tokens", 0),
                 "prompt_tokens_details": {"cached_tokens": result.get("cached_prompt_tokens", 0)}}
        if "reasoning_tokens" in result:  # a reasoning parser parted the thinking: its share, as OpenAI counts it
            usage["completion_tokens_details"] = {"reasoning_tokens": result["reasoning_tokens"]}
        completions = record.get("url") == "/v1/completions"
        if completions:
            body = {"id": f"cmpl-{result['id']}", "object": "text_completion", "created": int(time.time()),
                    "model": model, "choices": [{"index": i, "text": text, "logprobs": _completion_logprobs(lp),
                                                 "finish_reason": reason, "stop_reason": stop}
                                                for i, (text, reason, lp, stop) in enumerate(_choices(result))],
                    "usage": usage}
        else:
            body = {"id": f"chatcmpl-{result['id']}", "object": "chat.completion", "created": int(time.time()),
                    "model": model,
                    "choices": [{"index": i, "finish_reason": reason, "stop_reason": stop,
                                 "logprobs": _chat_logprobs(lp),
                                 "message": {"role": "assistant", "content": text, **thinking}}
                                for i, ((text, reason, lp, stop), thinking) in enumerate(zip(_choices(result),
                                                                                       _reasoning_of(result)))],
                    "usage": usage}
        return line_dict(OutputLine(id=line_id, custom_id=record.get("custom_id"),
                                    response=OutputResponse(status_code=200, request_id=request_id, body=body)))
    out = dict(record)
    for k in _GENERATED:
        if k in result:
            out[k] = result[k]
        elif k in _SAMPLE_COLUMNS and k in record:  # an input column of that name (the n/logprobs cell): one type
            out[k] = None
    if schema is not None and isinstance(result.get("output"), str):
        _add_structured(out, record, result["output"], fmt, schema)
    if "scores" in out:
        _add_class_scores(out, record, out.pop("scores"))
    return out


def embedding_body(result: dict, model: str, encoding_format: str | None) -> dict:
    """An embeddings response body as OpenAI returns it: one vector (``index`` 0), as floats or, for
    ``encoding_format: base64``, its little-endian float32 bytes in base64 (what OpenAI's client decodes)."""
    vector = result.get("embedding") or []
    if encoding_format == "base64":
        import numpy as np

        value: list[float] | str = base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    else:
        value = vector
    tokens = result.get("prompt_tokens", 0)
    return {"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": value}], "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _add_class_scores(out: dict, record: dict, scores: dict) -> None:
    """engine.task classify: one ``score_<class>`` column per class beside ``label`` (the top class), in every
    format (named ``output_<name>`` where the input has a column of that name, e.g. a gold ``label``)."""
    if "label" in out and (column := class_label_column(record)) != "label":
        out[column], out["label"] = out["label"], record["label"]  # the input's own column (a gold label) stays
    for name, p in scores.items():
        out[structured_column(class_score_column(name), record)] = p


def class_label_column(record: dict) -> str:
    """Where a classify row's top class is published: ``label``, or ``output_label`` beside an input ``label``."""
    return "output_label" if "label" in record else "label"


def class_score_column(label: str) -> str:
    return f"score_{label}"


def _choices(result: dict) -> list[tuple[str, str | None, list | None, str | int | None]]:
    """(text, finish reason, token logprobs, stop reason) of every sample of a result row: ``outputs`` where it
    has several (n > 1), else ``output`` alone. The stop reason is vLLM's: the stop string or stop token id that
    ended the sample, None where EOS or the length did (and where the engine does not say)."""
    if result.get("outputs"):
        n = len(result["outputs"])
        lps = result.get("outputs_logprobs") or [None] * n
        return list(zip(result["outputs"], result.get("finish_reasons") or [result.get("finish_reason")] * n, lps,
                        result.get("stop_reasons") or [result.get("stop_reason")] + [None] * (n - 1)))
    return [(result.get("output", ""), result.get("finish_reason"), result.get("logprobs"), result.get("stop_reason"))]


def _reasoning_of(result: dict) -> list[dict]:
    """Each sample's thinking as its chat message's ``reasoning_content`` (vLLM's server's field), where a
    reasoning parser parted it from the answer; nothing where none did."""
    if "reasoning" not in result:
        return [{}] * max(1, len(result.get("outputs") or ()))
    every = result.get("outputs_reasoning") or [result["reasoning"]]
    return [{"reasoning_content": r} for r in every]


def _chat_logprobs(tokens: list | None) -> dict | None:
    """A chat choice's ``logprobs`` as OpenAI writes it: ``content``, one entry per token with its UTF-8 bytes
    and its ``top_logprobs``."""
    if tokens is None:
        return None

    def entry(t: dict) -> dict:
        return {"token": t["token"], "logprob": t["logprob"], "bytes": list(t["token"].encode("utf-8"))}

    return {"content": [{**entry(t), "top_logprobs": [entry(c) for c in t["top"]]} for t in tokens],
            "refusal": None}


def _completion_logprobs(tokens: list | None) -> dict | None:
    """A completions choice's ``logprobs`` in OpenAI's legacy shape: parallel lists, offsets into the text."""
    if tokens is None:
        return None
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t["token"])
    return {"tokens": [t["token"] for t in tokens], "token_logprobs": [t["logprob"] for t in tokens],
            "top_logprobs": [{c["token"]: c["logprob"] for c in t["top"]} for t in tokens], "text_offset": offsets}


def _add_structured(out: dict, record: dict, text: str, fmt: str, schema: OutputSchema) -> None:
    """A schema-checked output as data: the object itself in JSONL, one typed column per top-level property
    in Parquet and CSV (named ``output_<name>`` where the input has a column of that name)."""
    try:
        value = json.loads(text)  # checked when generated; the content filter's masks keep it JSON
    except json.JSONDecodeError:
        return
    if fmt == "jsonl":
        out["output"] = value
        return
    for f in schema.arrow_fields():
        name = structured_column(f.name, record)
        out[name] = column_value(value.get(f.name) if isinstance(value, dict) else None, f.type)


def structured_column(name: str, record: dict) -> str:
    return f"output_{name}" if name in record or name in _GENERATED else name


_GENERATED = ("output", "finish_reason", "prompt_tokens", "cached_prompt_tokens", "completion_tokens", "filter_hits",
              "error", "outputs", "finish_reasons", "logprobs", "outputs_logprobs", "embedding", "label", "scores",
              "review_verdict", "review_categories", "review_error",
              "reasoning", "reasoning_tokens", "thinking_ended", "max_thinking_tokens", "outputs_reasoning")

_SAMPLE_COLUMNS = ("outputs", "finish_reasons", "logprobs", "outputs_logprobs")  # infer.results.SAMPLE_FIELDS



def openai_line_ids(run_id: str, where: str) -> tuple[str, str]:
    """(id, request_id) of one OpenAI Batch output or error line: unique per request as OpenAI's are (a custom_id
    is the caller's, not unique across runs or files), derived from the run and the request's place in its input
    (``where``: ``row <idx>``, or ``<file> line <n>`` for a line the planner refused), so a publish retried or
    resumed in the same run writes the same ids, and another run other ones."""
    digest = hashlib.sha256(f"{run_id}\0{where}".encode()).hexdigest()
    return f"batch_req_{digest[:24]}", f"req_{digest[24:48]}"


def openai_error_line(custom_id: str | int | None, message: str, *, code: str, run_id: str, where: str) -> dict:
    """A failed request as a line of an OpenAI Batch error file: the HTTP-style error body OpenAI returns for
    a request it refused (status 400), with the pipeline's reason as the message; ids as ``openai_line_ids``."""
    line_id, request_id = openai_line_ids(run_id, where)
    error = ErrorDetail(message=message, type="invalid_request_error", param=None, code=code)
    return line_dict(ErrorLine(id=line_id, custom_id=custom_id,
                               response=ErrorResponse(status_code=400, request_id=request_id,
                                                      body=ErrorBody(error=error))))


