"""A batch's output and error files, made from its run's published version: the published dataset (OpenAI
output lines, in input order) and its errors (OpenAI error lines), streamed into files of the store, each output
line's ``model`` the batch's model name (as ``batch-llm run-batch --served-model-name`` writes it)."""
from __future__ import annotations

from batch_llm.batch_api.store import BatchStore
from batch_llm.io.storage import Location, iter_jsonl, json_bytes
from batch_llm.manifests import PublishManifest
from batch_llm.rows.openai_batch import OutputLine, answer_line, line_dict


def _lines(path, model: str | None):
    for data in iter_jsonl(path):
        line = answer_line(data)
        if model is not None and isinstance(line, OutputLine):
            line.response.body["model"] = model
        yield json_bytes(line_dict(line)) + b"\n"


def _copy(store: BatchStore, lines, record: dict, purpose_name: str) -> dict | None:
    """A file of the batch (owner: the batch's) from ``lines``; None (and nothing kept) where there are none."""
    up = store.begin_upload(owner=record["owner"], filename=f"{record['id']}_{purpose_name}.jsonl", purpose="batch",
                            max_bytes=2**62, extra={"batch_id": record["id"], "dag_id": record["pipeline"]})
    up.meta["purpose"] = "batch_output"
    n = 0
    buf = bytearray()
    try:
        for line in lines:
            buf += line
            n += 1
            if len(buf) >= 1 << 16:
                up.write(bytes(buf))
                buf.clear()
        up.write(bytes(buf))
    except BaseException:
        up.abort()
        raise
    if n == 0:
        up.abort()
        return None
    return up.commit()


def publish_files(store: BatchStore, record: dict, manifest: PublishManifest, options: dict) -> dict:
    """Writes the batch's output and error files from the published version and records them in the batch's
    ``files.json``; a second call (the publish task retried) keeps the files of the first."""
    if (done := store.note(record["id"], "files")) is not None:
        return done
    out = _copy(store, _lines(Location(manifest.dataset, options).path(), record["model"]), record, "output")
    err = _copy(store, _lines(Location(manifest.errors, options).path(), None), record, "error")
    u = manifest.usage
    files = {"output_file_id": out["id"] if out else None, "error_file_id": err["id"] if err else None,
             "completed": manifest.rows, "failed": manifest.error_rows, "version": manifest.version,
             "report": manifest.report,
             "usage": {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
                       "output_tokens": u.completion_tokens,
                       "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
                       "total_tokens": u.prompt_tokens + u.completion_tokens}}
    return store.write_note(record["id"], "files", files, once=True)

