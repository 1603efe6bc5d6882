"""OpenAI Batch lines have one typed model each (rows/openai_batch.py): the request line the planner reads, and the
output and error lines the publisher writes and ``batch-llm run-batch`` reads back and writes again, unchanged."""
from __future__ import annotations

import json

import pytest
from batch_llm.rows.openai_batch import ErrorLine, OutputLine, RequestLine, answer_line, line_dict
from batch_llm.rows.prompt import request_line
from batch_llm.rows.records import openai_error_line, output_record

RESULT = {"id": "r1", "idx": 0, "output": "Paris", "finish_reason": "stop", "prompt_tokens": 7, "completion_tokens": 2}


@pytest.mark.parametrize("url", ["/v1/chat/completions", "/v1/completions"])
def test_output_line_reads_back_as_written(url):
    """A published output line is an OutputLine, and reads back into the same text, keys in OpenAI's order."""
    written = output_record({"custom_id": "a", "url": url, "body": {}}, RESULT, "openai_batch", model="m")
    assert list(written) == ["id", "custom_id", "response", "error"] and written["error"] is None
    line = answer_line(json.loads(json.dumps(written)))
    assert isinstance(line, OutputLine) and line.custom_id == "a" and line.response.status_code == 200
    assert json.dumps(line_dict(line), ensure_ascii=False) == json.dumps(written, ensure_ascii=False)


def test_error_line_reads_back_as_written():
    """A refused request's line is an ErrorLine (status 400, OpenAI's error body, ``param`` null) and reads back
    into the same text; an integer custom_id stays an integer; the ids come from the run and the line's place, not
    from the custom_id (which may be missing or repeat)."""
    for cid in ("x", 12, None):
        written = openai_error_line(cid, "bad row", code="invalid_request", run_id="r", where="in.jsonl line 3")
        line = answer_line(json.loads(json.dumps(written)))
        assert isinstance(line, ErrorLine) and line.custom_id == cid
        assert line.response.body.error.message == "bad row" and line.response.body.error.param is None
        assert json.dumps(line_dict(line)) == json.dumps(written)
    ids = {openai_error_line(None, "m", code="c", run_id="r", where=f"line {n}")["id"] for n in (1, 2)}
    assert len(ids) == 2 and all(i.startswith("batch_req_") for i in ids)


def test_request_line_is_checked_with_the_same_refusals():
    """The request line the planner reads: custom_id, method, url, body; each refusal as the planner words it."""
    ok = request_line({"custom_id": 3, "body": {"prompt": "hi"}, "url": "/v1/completions"})
    assert ok == RequestLine(custom_id=3, body={"prompt": "hi"}, url="/v1/completions", method="POST")
    for rec, message in [({"body": {}}, "missing id (column 'custom_id')"),
                         ({"custom_id": "a", "body": []}, "OpenAI batch line without a 'body' object"),
                         ({"custom_id": "a", "body": {}, "url": "/v1/embeddings"},
                          "url '/v1/embeddings' asks for a vector; this pipeline's engine.task generate answers"),
                         ({"custom_id": "a", "body": {}, "url": "/v1/files"}, "url '/v1/files' is not supported"),
                         ({"custom_id": "a", "body": {}, "method": "GET"}, "method 'GET': batch requests are POST")]:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            request_line(rec)
