"""Every value a row carries is bounded where rows are parsed, by the sampling section's own table
(``config.sampling.SAMPLING_BOUNDS``, vLLM's SamplingParams ranges): a value outside is that row's error with the reason,
and the other rows of the input go on. The sampling section refuses the same values."""
from __future__ import annotations

import json
import math

import pytest
from batch_llm.config import SamplingConfig
from batch_llm.config.sampling import MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, SAMPLING_BOUNDS
from batch_llm.io.storage import Location, iter_jsonl
from batch_llm.rows.params import MAX_NESTING, RowParams
from batch_llm.stages import plan as plan_mod
from helpers import demo_config
from pydantic import ValidationError

CHAT = [{"role": "user", "content": "hi"}]

# The OpenAI body field of each table key (its own name where it has no other)
BODY_NAME = {"max_thinking_tokens": "thinking_token_budget", "logprobs": "top_logprobs"}


def _body(name: str, value) -> dict:
    body = {"messages": CHAT, BODY_NAME.get(name, name): value}
    return {**body, "logprobs": True} if name == "logprobs" else body


def _outside(name: str) -> list:
    """Values just past each end of a key's bound, and ones no float or int64 holds."""
    b = SAMPLING_BOUNDS[name]
    if isinstance(b.hi, int) and isinstance(b.lo, int) and not b.lo_open:
        return [b.lo - 1, b.hi + 1, 2**70]
    return [b.lo if b.lo_open else b.lo - 0.01, b.hi + 0.01, math.inf, -math.inf, math.nan, 10**400]


def _nested(depth: int) -> dict:
    v: dict = {"leaf": 1}
    for _ in range(depth - 1):
        v = {"k": v}
    return v


@pytest.mark.parametrize("name", sorted(SAMPLING_BOUNDS))
def test_a_row_value_outside_its_bound_is_refused_naming_the_bound(name):
    b = SAMPLING_BOUNDS[name]
    for value in _outside(name):
        with pytest.raises(ValueError) as e:
            RowParams.from_openai_body(_body(name, value))
        assert f"{name} must be in {b}" in str(e.value) or (name == "max_tokens" and value < 1), (value, str(e.value))
        assert len(str(e.value)) < 200  # the reason is a line, however large the value
    # the ends themselves are values the engine takes
    for value in (b.hi, b.lo) if not b.lo_open else (b.hi,):
        assert RowParams.from_openai_body(_body(name, value)) is not None, (name, value)


@pytest.mark.parametrize("name", sorted(set(SAMPLING_BOUNDS) & set(SamplingConfig.model_fields)))
def test_the_sampling_section_is_held_to_the_same_table(name):
    for value in _outside(name):
        if isinstance(value, int) and value > 2**64:
            continue  # pydantic refuses those as too large already
        with pytest.raises(ValidationError):
            SamplingConfig(**{name: value})
    SamplingConfig(**{name: SAMPLING_BOUNDS[name].hi})


def test_lists_strings_and_objects_a_row_carries_are_bounded():
    cases = [
        ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, f"stop: at most {MAX_STOP_STRINGS} stop strings"),
        ({"stop": "y" * (MAX_STOP_CHARS + 1)}, f"stop: a stop string is at most {MAX_STOP_CHARS} characters"),
        ({"stop_token_ids": [2**70]}, "stop_token_ids: token ids are in [0, 2147483647], got 1180591620717411303424"),
        ({"stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)}, f"at most {MAX_STOP_TOKEN_IDS} token ids"),
        ({"chat_template_kwargs": _nested(MAX_NESTING + 1)}, f"chat_template_kwargs nests deeper than {MAX_NESTING}"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": _nested(MAX_NESTING + 1)}}},
         "json_schema nests deeper than"),
        ({"logit_bias": {str(2**70): 100}}, "logit_bias="), ({"min_tokens": 2**70}, "min_tokens="),
        ({"best_of": 2**70}, "best_of="), ({"seed": 1e30}, "seed must be in [0, 9223372036854775807]"),
        ({"temperature": "1"}, "temperature must be a number"),
    ]
    for body, words in cases:
        with pytest.raises(ValueError) as e:
            RowParams.from_openai_body({"messages": CHAT, **body})
        assert words in str(e.value) and len(str(e.value)) < 400, str(e.value)
    assert RowParams.from_openai_body({"messages": CHAT, "chat_template_kwargs": _nested(MAX_NESTING)}) is not None
    assert RowParams.from_openai_body({"messages": CHAT, "stop": ["x"] * MAX_STOP_STRINGS}) is not None
    with pytest.raises(ValidationError, match="at most 64 stop strings"):
        SamplingConfig(stop=["x"] * (MAX_STOP_STRINGS + 1))
    with pytest.raises(ValidationError, match="token ids are in"):
        SamplingConfig(stop_token_ids=[2**40])


def test_a_nan_cell_of_a_float_column_is_unset_but_a_nan_in_a_body_is_refused():
    assert RowParams.from_columns({"temperature": math.nan}, ["temperature"]) is None
    with pytest.raises(ValueError, match=r"temperature must be in \[0.0, 2.0\], got nan"):
        RowParams.from_openai_body({"messages": CHAT, "temperature": math.nan})


def test_rows_out_of_bounds_are_their_own_errors_and_the_others_are_planned(tmp_path):
    """One OpenAI Batch file: lines with a seed of 2**70, a huge prompt token id, an infinite temperature and a
    huge n, between good lines; each bad line is an error naming its bound, every good line is in a shard."""
    cmpl = "/v1/completions"
    bad = {"seed": {"seed": 2**70}, "ids": {"prompt": [2**70]}, "temp": {"temperature": 1e999},
           "n": {"n": 10**30}, "top_k": {"top_k": 2**40}}
    lines = []
    for i, (cid, body) in enumerate(bad.items()):
        lines.append({"custom_id": f"good{i}", "url": "/v1/chat/completions", "body": {"messages": CHAT, "seed": 5}})
        url = cmpl if "prompt" in body else "/v1/chat/completions"
        lines.append({"custom_id": cid, "url": url, "body": body if "prompt" in body else {"messages": CHAT, **body}})
    p = tmp_path / "batch.jsonl"
    # json writes Infinity for 1e999, as some producers do; the reader takes it as the number it names
    p.write_text("".join(json.dumps(x) + "\n" for x in lines))
    cfg = demo_config(tmp_path, input__path=str(p))
    m = plan_mod.write_plan(cfg, input_loc=Location(str(p)), plan_dir=Location(str(tmp_path / "plan")))
    rows = {r["id"] for s in m.shards for r in iter_jsonl(Location(s.url).path())}
    errors = {e["id"]: e["reason"] for e in iter_jsonl(Location(m.errors).path())}
    assert rows == {f"good{i}" for i in range(len(bad))} and set(errors) == set(bad)
    assert errors["seed"] == "seed must be in [0, 9223372036854775807], got an integer of 71 bits"
    assert errors["ids"] == "prompt_token_ids: token ids are in [0, 2147483647], got 1180591620717411303424"
    assert errors["temp"] == "temperature must be in [0.0, 2.0], got inf"
    assert errors["n"] == "n must be in [1, 128], got an integer of 100 bits"
    assert errors["top_k"] == "top_k must be in [-1, 2147483647], got 1099511627776"


def test_a_refused_value_too_deep_to_print_is_still_the_rows_error():
    deep: list = []
    for _ in range(5000):
        deep = [deep]
    for body in ({"stop": deep}, {"logit_bias": deep}, {"temperature": deep}):
        with pytest.raises(ValueError, match="a value nested too deep to show"):
            RowParams.from_openai_body({"messages": CHAT, **body})


@pytest.mark.parametrize(("ids", "error"), [
    ([7, 0, 2**31 - 1], None),
    ([True, 3], None),  # a bool is an int to the check, as it always was
    ([5, 2**70, 9], "prompt_token_ids: token ids are in [0, 2147483647], got 1180591620717411303424"),
    ([5, -1], "prompt_token_ids must be a non-empty list of token ids"),
    ([5, 1.0], "prompt_token_ids must be a non-empty list of token ids"),
    ([5, "6"], "prompt_token_ids must be a non-empty list of token ids"),
    ([], "prompt_token_ids must be a non-empty list of token ids"),
])
def test_a_prompts_token_ids_are_checked_whole_in_the_common_case_and_name_the_bad_one(ids, error):
    """A list of plain ints is checked by its type set, minimum and maximum (in C); anything else item by item:
    the same verdicts and the same messages either way."""
    from batch_llm.rows.prompt import _check_token_ids

    if error is None:
        assert _check_token_ids(ids) is ids
    else:
        with pytest.raises(ValueError) as e:
            _check_token_ids(ids)
        assert str(e.value) == error
