"""A row's ``response_format`` is read in one place (rows/params.py): the output check, vLLM's and SGLang's grammars
and the common-ai front-end agree on the schema an OpenAI ``response_format`` asks for."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from batch_llm.engines.sglang_config import row_json_schema
from batch_llm.frontends.common_ai import response_format_schema
from batch_llm.rows.params import RowParams, response_schema, row_response_format

INCLUDE = Path(__file__).resolve().parents[2] / "include"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "n": {"type": "integer"}},
          "required": ["city"]}
FORMATS = [{"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}]


def _row_format(rf: dict | None) -> str | None:
    body = {"messages": [{"role": "user", "content": "hi"}], "response_format": rf}
    params = RowParams.from_openai_body(body, completions=False)
    return params.response_format if params is not None else None


@pytest.mark.parametrize("rf", FORMATS, ids=["json_object", "json_schema"])
def test_every_reader_takes_the_same_schema(rf):
    """The planner's check, the common-ai front-end, SGLang's json_schema and vLLM's structured outputs read one
    schema from one response_format: {"type": "object"} for json_object, the schema itself for json_schema."""
    own = _row_format(rf)
    expected = {"type": "object"} if rf["type"] == "json_object" else SCHEMA
    assert response_schema(own) == expected
    assert response_format_schema(rf) == expected
    assert json.loads(row_json_schema(own) or "null") == expected
    read = row_response_format(own)
    assert read is not None and read.schema == expected and read.json_object == (rf["type"] == "json_object")
    vllm_engine = pytest.importorskip("batch_llm.engines.vllm_engine")
    structured = vllm_engine.row_structured_outputs(own)
    if rf["type"] == "json_object":
        assert structured.json_object is True
    else:
        assert structured.json == expected


def test_text_is_no_format_anywhere():
    """type text (and no response_format) asks for no schema in any reader."""
    assert _row_format({"type": "text"}) is None and _row_format(None) is None
    assert response_schema(None) is None and row_json_schema(None) is None and row_response_format(None) is None
    assert response_format_schema({"type": "text"}) is None and response_format_schema(None) is None


def test_only_rows_params_parses_a_response_format():
    """No module but rows/params.py decodes a row's response_format text: the engines take ``row_response_format``."""
    readers = sorted(str(p.relative_to(INCLUDE)) for p in INCLUDE.rglob("*.py")
                     if "json.loads(response_format" in p.read_text())
    assert readers == ["batch_llm/rows/params.py"]
