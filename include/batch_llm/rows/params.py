"""A row's own sampling parameters: the fields of an OpenAI Batch request body, or columns of a table.

The pipeline's ``sampling`` section is the default; a row overrides only what it sets. ``sampling.max_tokens``
is the default output limit, and a cap only where ``sampling.max_tokens_cap`` is configured (capped rows are
counted by the planner). A parameter the pipeline or its engine cannot honor is a row error with the reason,
never silently dropped: every field of an OpenAI or vLLM request body is in ``HONOURED``, ``NO_EFFECT`` or
``REFUSED`` (refused unless at a neutral value, with the reason), and a field in none of them is refused
as unknown, as OpenAI's API does; ``n > 1``, log-probabilities, penalties, ``top_k`` ... on engines without them are
refused naming the engines with them (the capability table).

    params = RowParams.from_openai_body(body)          # ValueError names what is refused
    sampling = params.resolve(cfg.sampling)            # every field set: what the engine is asked for
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, NamedTuple, overload

from batch_llm.config import SamplingConfig
from batch_llm.config.capabilities import ENGINES, who_can
from batch_llm.config.sampling import RESERVED_TEMPLATE_KWARGS, SAMPLING_BOUNDS, stop_problem, token_ids_problem
from batch_llm.reasoning import THINKING_MODES, TemplateThinking, effort_variables, thinking_variables

# What becomes of each field of an OpenAI Batch request body: OpenAI's chat and completions fields and vLLM's extra
# ones (its ChatCompletionRequest / CompletionRequest). A unit test walks every field of both and finds it here.
#: Fields read into the row's parameters (or its prompt).
HONOURED = frozenset({"messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "stop",
                      "seed", "presence_penalty", "frequency_penalty", "n", "logprobs", "top_logprobs", "top_k",
                      "min_p", "repetition_penalty", "stop_token_ids", "include_stop_str_in_output",
                      "chat_template_kwargs", "response_format", "reasoning_effort", "thinking_token_budget"})
#: Fields that do not change what is generated, accepted at any value (why).
NO_EFFECT = {
    "model": "the pipeline's model serves every row; the output line names it",
    "user": "an end-user id for OpenAI's monitoring", "metadata": "tags of the request", "store": "OpenAI's storage",
    "service_tier": "OpenAI's processing tier", "safety_identifier": "an end-user id for OpenAI's monitoring",
    "prompt_cache_key": "routing for OpenAI's prompt cache (the engine's prefix cache needs none)",
    "prompt_cache_retention": "OpenAI's prompt cache", "prompt_cache_options": "OpenAI's prompt cache",
    "stream_options": "streaming only (stream is refused)", "stream_interval": "streaming only (stream is refused)",
    "parallel_tool_calls": "tools only (tools are refused)", "request_id": "the line's custom_id names the request",
    "priority": "a scheduling order; every row of the batch runs", "cache_salt": "isolates vLLM's prefix cache",
}
_TEXT_ONLY = "text rows and text outputs only"
_SERVER_ONLY = "an option of vLLM's server, not of a batch"
#: Fields refused unless absent or at one of these neutral values: (neutral values, why).
REFUSED: dict[str, tuple[tuple, str]] = {
    "best_of": ((None, 1), "no best_of"), "echo": ((None, False), "no echo"), "suffix": ((None, ""), "no suffix"),
    "stream": ((None, False), "a batch writes whole outputs"),
    "tools": ((None, []), "no tools"), "functions": ((None, []), "no tools"),
    "tool_choice": ((None, "none"), "no tools"), "function_call": ((None, "none"), "no tools"),
    "logit_bias": ((None, {}), "no logit bias"), "audio": ((None,), _TEXT_ONLY),
    "modalities": ((None, ["text"]), _TEXT_ONLY), "prediction": ((None,), "no predicted outputs"),
    "web_search_options": ((None,), "no web search"), "moderation": ((None,), "no moderation"),
    "verbosity": ((None,), "an option of OpenAI's reasoning models"),
    "use_beam_search": ((None, False), "no beam search"), "length_penalty": ((None, 1, 1.0), "beam search only"),
    "min_tokens": ((None, 0), "no minimum output length"),
    "ignore_eos": ((None, False), "sampling.ignore_eos sets it for the pipeline"),
    "allowed_token_ids": ((None,), "no token allow-list"), "bad_words": ((None, []), "no banned words"),
    "skip_special_tokens": ((None, True), "outputs are decoded without special tokens"),
    "spaces_between_special_tokens": ((None, True), "outputs are decoded as vLLM does by default"),
    "prompt_logprobs": ((None,), "no prompt log-probabilities"),
    "logprob_token_ids": ((None,), "log-probabilities of the chosen and top tokens only"),
    "truncate_prompt_tokens": ((None,), "prompts are not truncated: one longer than the context is a row error"),
    "truncation_side": ((None,), "prompts are not truncated"),
    "add_generation_prompt": ((None, True), "chats are rendered with the generation prompt"),
    "continue_final_message": ((None, False), "chats are rendered with the generation prompt"),
    "chat_template": ((None,), "model.chat_template sets the pipeline's template"),
    "documents": ((None,), "no documents for the chat template"),
    "include_reasoning": ((None, True), "the thinking is kept, apart from the answer, where the engine has a "
                          "reasoning parser (engine.reasoning_parser)"),
    "structured_outputs": ((None,), "response_format (json_schema, json_object) or sampling.output_schema instead"),
    "return_token_ids": ((None, False), "output lines carry OpenAI's fields"),
    "return_tokens_as_token_ids": ((None, False), "output lines carry OpenAI's fields"),
    "return_token_offsets": ((None, False), "output lines carry OpenAI's fields"),
    "return_prompt_text": ((None, False), "output lines carry OpenAI's fields"),
    "return_mm_kwargs": ((None, False), _TEXT_ONLY), "mm_processor_kwargs": ((None, {}), _TEXT_ONLY),
    "media_io_kwargs": ((None, {}), _TEXT_ONLY), "mm_payload": ((None,), _TEXT_ONLY),
    "prompt_embeds": ((None,), "text or token-id prompts only"),
    "repetition_detection": ((None,), "no repetition detection"), "watermarking": ((None,), "no watermarking"),
    "vllm_xargs": ((None, {}), "no custom sampling arguments"), "routed_experts_prompt_start": ((None,), _SERVER_ONLY),
    "kv_transfer_params": ((None,), _SERVER_ONLY), "ec_transfer_params": ((None,), _SERVER_ONLY),
    "session_id": ((None,), _SERVER_ONLY),
}
# What becomes of each field of a ``/v1/embeddings`` body: OpenAI's (its EmbeddingCreateParams) and vLLM's extra ones
# (its EmbeddingCompletionRequest). A unit test walks every field of both and finds it here.
#: Fields read into the row (its input, its own parameters, its output line's encoding).
EMBED_HONOURED = frozenset({"input", "dimensions", "encoding_format"})
#: Fields that do not change the vector, accepted at any value (why).
EMBED_NO_EFFECT = {k: NO_EFFECT[k] for k in ("model", "user", "request_id", "priority", "cache_salt")}
#: Fields refused unless absent or at one of these neutral values: (neutral values, why).
EMBED_REFUSED: dict[str, tuple[tuple, str]] = {
    "embed_dtype": ((None, "float32"), "vectors are float32, as OpenAI returns them"),
    "endianness": ((None, "little"), "a base64 vector is little-endian float32, as OpenAI returns it"),
    "use_activation": ((None,), "engine.embed.normalize sets it for the pipeline"),
    "add_special_tokens": ((None, True), "an embeddings input gets the tokenizer's special tokens"),
    "padding": ((None, "do_not_pad"), "inputs are not padded"),
    "truncate_prompt_tokens": REFUSED["truncate_prompt_tokens"], "truncation_side": REFUSED["truncation_side"],
    "mm_processor_kwargs": ((None, {}), _TEXT_ONLY),
}
#: OpenAI's two encodings of a vector in an embeddings response.
ENCODING_FORMATS = ("float", "base64")

# add_special_tokens: a chat body's rendered prompt gets none (the template has them), a completions body's does
_SPECIAL_TOKENS_NEUTRAL = {False: (None, False), True: (None, True)}

# The per-row parameters each engine applies come from its row of the capability table (``row_params``); any
# other set parameter is a row error on that engine.

# Table columns that may carry per-row parameters: config.input.SamplingColumn (``input.sampling_columns`` picks which).
# A row's numbers are held to config.sampling.SAMPLING_BOUNDS, the sampling section's own table.

# The deepest nesting of a row's objects (chat_template_kwargs, a json_schema): deeper ones are the row's error
# rather than a recursion in the template renderer or the schema compiler.
MAX_NESTING = 32


@dataclass(frozen=True)
class Sampling:
    """Every sampling parameter of one request, resolved: the pipeline's defaults under the row's own."""

    max_tokens: int
    temperature: float
    top_p: float
    stop: tuple[str, ...]
    seed: int | None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    n: int = 1                    # samples of the request
    logprobs: int | None = None   # top-k log-probabilities per generated token (0: the chosen token's only)
    top_k: int = 0                # 0: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    response_format: str | None = None  # the row's own: canonical JSON of {"type": "json_object"} or a json_schema
    max_thinking_tokens: int | None = None  # vLLM's thinking budget (thinking_token_budget); None: none


@dataclass(frozen=True)
class RowParams:
    """What one row sets (None: the pipeline's value). Hashable: engines build one engine-side parameter
    object per distinct value, not per row."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: tuple[str, ...] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    n: int | None = None
    logprobs: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: tuple[int, ...] | None = None
    include_stop_str_in_output: bool | None = None
    # objects as canonical JSON text (hashable); to_json / from_json give and take the objects
    chat_template_kwargs: str | None = None
    response_format: str | None = None
    # a reasoning model's thinking (batch_llm.reasoning): the switch (on / off / auto), OpenAI's reasoning_effort
    # (template variables, like chat_template_kwargs), and the thinking budget
    thinking: str | None = None
    reasoning_effort: str | None = None
    max_thinking_tokens: int | None = None
    # engine.task embed: the vector's width, for a model trained to be cut (matryoshka); vLLM refuses it for others
    dimensions: int | None = None

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_openai_body(cls, body: dict, *, completions: bool = False) -> RowParams | None:
        """The parameters of a ``/v1/chat/completions`` body (or a ``/v1/completions`` one: ``completions``);
        ValueError for a field that would change the output and that the pipeline does not do, or that is in none
        of the tables above."""
        for name, value in body.items():
            if name in HONOURED or name in NO_EFFECT:
                continue
            if name == "add_special_tokens":
                neutral = _SPECIAL_TOKENS_NEUTRAL[completions]
                why = "the prompt's special tokens are the chat template's" if not completions else \
                    "a completions prompt gets the tokenizer's special tokens"
            elif name in REFUSED:
                neutral, why = REFUSED[name]
            else:
                shown = name if len(name) <= 64 else name[:64] + "..."
                raise ValueError(f"{shown}: not a field of an OpenAI or vLLM chat or completions request (an unknown "
                                 "field is refused, not ignored)")
            if value not in neutral:
                raise ValueError(f"{name}={_shown(value)} is not supported by this batch pipeline ({why})")
        limit = body.get("max_completion_tokens")
        values = {"max_tokens": limit if limit is not None else body.get("max_tokens"),
                  "logprobs": _openai_logprobs(body, completions),
                  "response_format": _response_format(body.get("response_format")),
                  "reasoning_effort": body.get("reasoning_effort"),
                  "max_thinking_tokens": body.get("thinking_token_budget"),
                  **{k: body.get(k) for k in ("temperature", "top_p", "stop", "seed", "presence_penalty",
                                               "frequency_penalty", "n", *_EXTRA)}}
        return cls.from_values(values, nan_unset=False)

    @classmethod
    def from_embeddings_body(cls, body: dict) -> RowParams | None:
        """The parameters of a ``/v1/embeddings`` body (its ``dimensions``); ValueError for a field the pipeline
        does not do, a field of no embeddings request, or an ``encoding_format`` OpenAI does not have."""
        for name, value in body.items():
            if name in EMBED_HONOURED or name in EMBED_NO_EFFECT:
                continue
            if name not in EMBED_REFUSED:
                shown = name if len(name) <= 64 else name[:64] + "..."
                raise ValueError(f"{shown}: not a field of an OpenAI or vLLM embeddings request (an unknown field is "
                                 "refused, not ignored)")
            neutral, why = EMBED_REFUSED[name]
            if value not in neutral:
                raise ValueError(f"{name}={_shown(value)} is not supported by this batch pipeline ({why})")
        if body.get("encoding_format") not in (None, *ENCODING_FORMATS):
            raise ValueError(f"encoding_format must be {' or '.join(ENCODING_FORMATS)}, got "
                             f"{_shown(body['encoding_format'])}")
        return cls.from_values({"dimensions": body.get("dimensions")}, nan_unset=False)

    @classmethod
    def from_columns(cls, record: dict, columns: Sequence[str]) -> RowParams | None:
        """The parameters a table row carries in the configured columns (empty cells are unset)."""
        return cls.from_values({c: record.get(c) for c in columns})

    @classmethod
    def from_values(cls, values: dict, *, nan_unset: bool = True) -> RowParams | None:
        """Each value checked against its bounds (ValueError names the field). ``nan_unset``: a NaN is unset, as
        a float column's missing cell is (pandas writes NaN); in a request body it is a value, and refused."""
        out = {}
        for name, v in values.items():
            if v is None or (nan_unset and isinstance(v, float) and v != v) or v == "":  # unset, or an empty CSV cell
                continue
            out[name] = _check(name, v)
        return cls(**out) if out else None

    @classmethod
    def from_json(cls, d: dict | None) -> RowParams | None:
        if not d:
            return None
        # each field as the dataclass holds it: lists as tuples, objects as canonical JSON, the rest as they are
        values: dict[str, Any] = {k: (tuple(v) if k in _TUPLES else _canonical(v) if k in _OBJECTS else v)
                                  for k, v in d.items()}
        return cls(**values)

    # ------------------------------------------------------------------ use
    def to_json(self) -> dict:
        """Only the fields the row sets (what shard rows, spools and cache keys carry)."""
        # the fields are flat and immutable (tuples, strings, numbers): read as they are, not deep-copied by
        # asdict (a shard row's parameters are written once per row: the copy was a tenth of planning a row)
        values = ((k, getattr(self, k)) for k in _FIELD_NAMES)
        return {k: (list(v) if k in _TUPLES else json.loads(v) if k in _OBJECTS else v)
                for k, v in values if v is not None}

    def template_kwargs(self) -> dict:
        """The row's chat template variables ({} where it sets none)."""
        return json.loads(self.chat_template_kwargs) if self.chat_template_kwargs else {}

    def set_names(self) -> set[str]:
        return {f.name for f in fields(self) if getattr(self, f.name) is not None}

    def resolve(self, s: SamplingConfig) -> Sampling:
        return resolve(self, s)

    def capped(self, cap: int | None) -> tuple[RowParams, bool]:
        """(these parameters with max_tokens at most ``cap``, whether it was lowered)."""
        if cap is None or self.max_tokens is None or self.max_tokens <= cap:
            return self, False
        return replace(self, max_tokens=cap), True


def resolve(p: RowParams | None, s: SamplingConfig) -> Sampling:
    """The request's full sampling: the row's values where it sets them, else the pipeline's."""
    def pick(name, default):
        v = getattr(p, name) if p is not None else None
        return default if v is None else v

    return Sampling(max_tokens=pick("max_tokens", s.max_tokens), temperature=pick("temperature", s.temperature),
                    top_p=pick("top_p", s.top_p), stop=pick("stop", tuple(s.stop)), seed=pick("seed", s.seed),
                    ignore_eos=s.ignore_eos, presence_penalty=pick("presence_penalty", 0.0),
                    frequency_penalty=pick("frequency_penalty", 0.0), n=pick("n", s.n),
                    logprobs=pick("logprobs", s.logprobs), top_k=pick("top_k", s.top_k), min_p=pick("min_p", s.min_p),
                    repetition_penalty=pick("repetition_penalty", s.repetition_penalty),
                    stop_token_ids=pick("stop_token_ids", tuple(s.stop_token_ids)),
                    include_stop_str_in_output=pick("include_stop_str_in_output", s.include_stop_str_in_output),
                    response_format=pick("response_format", None),
                    max_thinking_tokens=pick("max_thinking_tokens", s.max_thinking_tokens))


def template_kwargs(p: RowParams | None, s: SamplingConfig, tt: TemplateThinking | None = None) -> dict:
    """The chat template variables of a row: the pipeline's (``chat_template_kwargs``, then the switch of
    ``sampling.thinking``), under the row's own (its ``chat_template_kwargs``, then its ``thinking`` and
    ``reasoning_effort``). ``tt``: what the model's template says about thinking; ThinkingRefused where it cannot
    honour a thinking setting (``batch_llm.reasoning``)."""
    tt = tt or TemplateThinking()
    row = p or RowParams()
    return {**s.chat_template_kwargs, **thinking_variables(s.thinking, tt), **row.template_kwargs(),
            **thinking_variables(row.thinking, tt), **effort_variables(row.reasoning_effort, tt)}


@overload
def response_schema(response_format: str) -> dict: ...


@overload
def response_schema(response_format: None) -> None: ...


def response_schema(response_format: str | None) -> dict | None:
    """The JSON Schema a row's response_format checks its output against ({"type": "object"} for json_object)."""
    rf = row_response_format(response_format)
    return None if rf is None else rf.schema


class ResponseFormat(NamedTuple):
    """A row's own response_format, read: what an engine decodes under and the planner checks against."""

    json_object: bool  # OpenAI's json_object: any JSON object
    schema: dict       # json_schema: its schema; json_object: {"type": "object"}


def row_response_format(response_format: str | None) -> ResponseFormat | None:
    """A row's response_format (``RowParams.response_format``: the canonical JSON ``_response_format`` wrote), read;
    None for plain text. Every reader of it (the output check, each engine's grammar) reads it here."""
    if response_format is None:
        return None
    rf = json.loads(response_format)
    if rf["type"] == "json_object":
        return ResponseFormat(json_object=True, schema={"type": "object"})
    return ResponseFormat(json_object=False, schema=rf["schema"])


def openai_response_format(rf: Any) -> tuple[Any, Any]:
    """OpenAI's ``response_format`` object, as sent: its ``type`` and, for json_schema, its ``json_schema.schema``
    (``name`` and ``strict`` are the API's own); (None, None) for what is no object. Its callers check both."""
    if not isinstance(rf, Mapping):
        return None, None
    kind = rf.get("type")
    inner = rf.get("json_schema")
    return kind, (inner.get("schema") if kind == "json_schema" and isinstance(inner, Mapping) else None)


def _response_format(rf: Any) -> dict | None:
    """OpenAI's response_format as the row's own: None for text, {"type": "json_object"}, or {"type": "json_schema",
    "schema": ...}; ValueError for any other shape or an invalid JSON Schema."""
    if rf is None:
        return None
    kind, schema = openai_response_format(rf)
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(schema, dict):
            raise ValueError("response_format json_schema needs json_schema.schema, a JSON Schema object")
        if problem := _nesting_problem(schema, "response_format's json_schema"):
            raise ValueError(problem)
        from batch_llm.output_schema import check_schema

        return {"type": "json_schema", "schema": check_schema(schema)}
    raise ValueError(f"response_format={_shown(rf)}: type text, json_object or json_schema")


_EXTRA = ("top_k", "min_p", "repetition_penalty", "stop_token_ids", "include_stop_str_in_output", "chat_template_kwargs")
_FIELD_NAMES = tuple(f.name for f in fields(RowParams))
_TUPLES = ("stop", "stop_token_ids")
_OBJECTS = ("chat_template_kwargs", "response_format")


def _canonical(v: Any) -> str:
    return json.dumps(v, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _openai_logprobs(body: dict, completions: bool):
    """The top-k a body asks for, or None. Chat bodies say ``logprobs: true`` (+ ``top_logprobs: k``, 0 when
    absent); completions bodies give k as ``logprobs`` itself, as OpenAI's two endpoints do."""
    lp, top = body.get("logprobs"), body.get("top_logprobs")
    if completions:
        if top is not None:
            raise ValueError("top_logprobs is a chat field; a /v1/completions body gives k as logprobs")
        return None if lp is None or lp is False else lp  # False: as absent; True/other types: _check says
    if lp not in (None, False, True):
        raise ValueError(f"logprobs must be true or false in a chat body (top_logprobs gives k), got {_shown(lp)}")
    if lp is not True:
        if top not in (None, 0):
            raise ValueError(f"top_logprobs={_shown(top)} needs logprobs: true")
        return None
    return 0 if top is None else top


def engine_refusal(p: RowParams | None, engine_kind: str) -> str | None:
    """Why the engine cannot honor this row's parameters, or None."""
    if p is None:
        return None
    caps = ENGINES.get(engine_kind)
    missing = sorted(p.set_names() - (caps.row_params if caps else frozenset()))
    if not missing:
        return None
    return f"engine {engine_kind} cannot apply per-row {', '.join(missing)} ({who_can(lambda c: c.row_params >= set(missing))})"


def _check(name: str, v):
    """One value, validated as OpenAI's API does (ranges included); ValueError names the field."""
    if name in ("max_tokens", "seed", "n", "logprobs", "top_k", "max_thinking_tokens"):
        v = _check_int(name, v)
        return 0 if name == "top_k" and v == -1 else v  # vLLM's two spellings of "off": one key
    if name in _SHAPED:
        return _SHAPED[name](v)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{name} must be a number, got {_shown(v)}")
    try:
        v = float(v)
    except OverflowError:  # an integer past any float
        raise ValueError(f"{name} must be in {SAMPLING_BOUNDS[name]}, got an integer of {v.bit_length()} bits") from None
    if not SAMPLING_BOUNDS[name].holds(v):  # NaN and the infinities included
        raise ValueError(f"{name} must be in {SAMPLING_BOUNDS[name]}, got {v}")
    return v


def _check_stop(v: Any) -> tuple[str, ...]:
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(x, str) and x for x in stops):
        raise ValueError(f"stop must be a string or a list of strings, got {_shown(v)}")
    if problem := stop_problem(stops):
        raise ValueError(f"stop: {problem}")
    return tuple(stops)


def _check_token_ids(v: Any) -> tuple[int, ...] | None:
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in v):
        raise ValueError(f"stop_token_ids must be a list of token ids, got {_shown(v)}")
    if problem := token_ids_problem(v, "stop_token_ids"):
        raise ValueError(problem)
    return tuple(v) if v else None


def _shown(v: Any, most: int = 200) -> str:
    """A refused value in its reason, cut: a row's reason stays a line however large (or deep) the value."""
    try:
        text = repr(v)
    except RecursionError:
        return "a value nested too deep to show"
    return text if len(text) <= most else f"{text[:most]}... ({len(text)} characters)"


def _nesting_problem(v: Any, name: str) -> str | None:
    """Why an object nests too deep (``MAX_NESTING``), or None; walked without recursion."""
    level = [v]
    for _ in range(MAX_NESTING + 1):
        level = [x for c in level for x in (c.values() if isinstance(c, dict) else c if isinstance(c, list) else ())]
        if not level:
            return None
    return f"{name} nests deeper than {MAX_NESTING} levels"


def _check_bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError(f"include_stop_str_in_output must be true or false, got {_shown(v)}")
    return v


def _check_thinking(v: Any) -> str:
    """auto, on or off; true / false (a boolean column) are on / off."""
    if isinstance(v, bool):
        return "on" if v else "off"
    if not isinstance(v, str) or v.strip().lower() not in THINKING_MODES:
        raise ValueError(f"thinking must be auto, on or off (or true / false), got {_shown(v)}")
    return v.strip().lower()


# OpenAI's reasoning_effort values
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def _check_effort(v: Any) -> str:
    if v not in REASONING_EFFORTS:
        raise ValueError(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got {_shown(v)}")
    return v


def _check_dimensions(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"dimensions must be a positive integer, got {_shown(v)}")
    return v


_SHAPED = {"dimensions": _check_dimensions, "stop": _check_stop, "thinking": _check_thinking, "reasoning_effort": _check_effort,
           "stop_token_ids": _check_token_ids, "include_stop_str_in_output": _check_bool,
           "chat_template_kwargs": lambda v: _canonical(check_template_kwargs(v)) if v else None,
           "response_format": lambda v: _canonical(v) if v else None}


def check_template_kwargs(v: Any) -> dict:
    """Chat template variables: a JSON object whose keys are not apply_chat_template's own arguments, nested at
    most ``MAX_NESTING`` levels."""
    if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
        raise ValueError(f"chat_template_kwargs must be an object of template variables, got {_shown(v)}")
    if problem := _nesting_problem(v, "chat_template_kwargs"):
        raise ValueError(problem)
    reserved = sorted(set(v) & RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise ValueError(f"chat_template_kwargs: {', '.join(reserved)}: arguments of the tokenizer's "
                         "apply_chat_template, not template variables")
    return v


def _check_int(name: str, v):
    if isinstance(v, float) and v.is_integer():  # a Parquet/CSV integer column with gaps is float
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        kind = "a positive integer" if name in ("max_tokens", "n") else "an integer"
        raise ValueError(f"{name} must be {kind}, got {_shown(v)}")
    bound = SAMPLING_BOUNDS[name]
    if not bound.holds(v):
        if name == "max_tokens" and v < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {v!r}")
        shown = v if v.bit_length() <= 64 else f"an integer of {v.bit_length()} bits"
        raise ValueError(f"{name} must be in {bound}, got {shown}")
    return v
