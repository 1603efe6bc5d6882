"""The ``sampling`` section, and the bounds of every sampling value (``SAMPLING_BOUNDS``, stop strings, token ids)
that a row's own values are held to as well (``rows/params.py``)."""
from __future__ import annotations

import typing
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from batch_llm.config.section import Section
from batch_llm.reasoning import SWITCH_VARIABLES

# apply_chat_template's own arguments: a template variable of one of these names would be taken as the argument
RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tools", "documents", "chat_template",
                                      "add_generation_prompt", "continue_final_message", "tokenize", "padding",
                                      "truncation", "max_length", "return_tensors", "return_dict",
                                      "return_assistant_tokens_mask", "tokenizer_kwargs"})

# torch's generators (vLLM's per-request seeds, the transformers engine) take 64-bit seeds; vLLM reads -1 as "no
# seed". Non-negative int64 leaves room for output_retries' reseeding (seed + 1_000_003 per attempt).
MAX_SEED = 2**63 - 1
# vLLM keeps token counts, top_k and token ids in int32 tensors; a larger integer would fail the engine, not the row
MAX_INT32 = 2**31 - 1


class Bound(typing.NamedTuple):
    """The range of one sampling value: [lo, hi], or (lo, hi] where ``lo_open``."""

    lo: int | float
    hi: int | float
    lo_open: bool = False

    def field(self) -> dict[str, Any]:
        """The bound as pydantic ``Field`` constraints (the sampling section's keys)."""
        return {"gt" if self.lo_open else "ge": self.lo, "le": self.hi}

    def holds(self, v: int | float) -> bool:
        """Whether ``v`` is within (NaN is within no bound)."""
        return (self.lo < v if self.lo_open else self.lo <= v) and v <= self.hi

    def __str__(self) -> str:
        return f"{'(' if self.lo_open else '['}{self.lo}, {self.hi}]"


# Every sampling value's bounds, the engine's own (vLLM's SamplingParams._verify_args; logprobs: its default
# max_logprobs, OpenAI's top_logprobs limit; n: OpenAI's limit, well under vLLM's 16384 samples a request): the
# sampling section's keys and a row's own values (rows/params.py) are held to this one table, so a row outside it is
# that row's error, never an engine failure that takes the run's other rows with it.
SAMPLING_BOUNDS: dict[str, Bound] = {
    "max_tokens": Bound(1, MAX_INT32), "n": Bound(1, 128), "logprobs": Bound(0, 20), "seed": Bound(0, MAX_SEED),
    "top_k": Bound(-1, MAX_INT32), "max_thinking_tokens": Bound(0, MAX_INT32),
    "temperature": Bound(0.0, 2.0), "top_p": Bound(0.0, 1.0, lo_open=True), "min_p": Bound(0.0, 1.0),
    "presence_penalty": Bound(-2.0, 2.0), "frequency_penalty": Bound(-2.0, 2.0),
    "repetition_penalty": Bound(0, 100, lo_open=True),
}
# Stop strings are matched against every output's tail at every step: their count and length bound that work
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
TOKEN_ID = Bound(0, MAX_INT32)
_BOUNDS = SAMPLING_BOUNDS  # the sampling section's fields read their bounds from it


def stop_problem(stops: typing.Sequence[str]) -> str | None:
    """Why a list of stop strings cannot be used (empty strings, too many, too long), or None."""
    if any(not x for x in stops):
        return f"an empty stop string matches everywhere: {list(stops)!r}"
    if len(stops) > MAX_STOP_STRINGS:
        return f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}"
    longest = max(stops, key=len, default="")
    if len(longest) > MAX_STOP_CHARS:
        return f"a stop string is at most {MAX_STOP_CHARS} characters, got one of {len(longest)}"
    return None


def plain_token_ids(ids: typing.Sequence[Any]) -> bool:
    """Whether ``ids`` are plain ints, at least one, all within ``TOKEN_ID``: checked whole, in C (a prompt's ids are
    checked per row, millions of tokens a day); False says only that the item-by-item check must decide."""
    return bool(ids) and set(map(type, ids)) == {int} and TOKEN_ID.holds(min(ids)) and TOKEN_ID.holds(max(ids))


def token_ids_problem(ids: typing.Sequence[int], name: str, *, most: int | None = MAX_STOP_TOKEN_IDS) -> str | None:
    """Why a list of token ids cannot be used (outside ``TOKEN_ID``, more than ``most``), or None."""
    if most is not None and len(ids) > most:
        return f"{name}: at most {most} token ids, got {len(ids)}"
    if plain_token_ids(ids):
        return None
    if (bad := next((t for t in ids if not TOKEN_ID.holds(t)), None)) is not None:
        return f"{name}: token ids are in {TOKEN_ID}, got {bad}"
    return None


class SamplingConfig(Section):
    """The default sampling of every request; a row may set its own (``rows/params.py``). A row's values are held to
    the bounds shown here (the engine's own, vLLM's SamplingParams ranges: one table, ``SAMPLING_BOUNDS``); a row
    outside them is that row's error with the reason, the other rows go on."""

    max_tokens: int = Field(256, **_BOUNDS["max_tokens"].field(), description="The output limit of a row that "
                            "sets none")
    max_tokens_cap: int | None = Field(None, **_BOUNDS["max_tokens"].field(), description="When set, no row "
                                       "generates more than this (rows asking for more are capped and counted)")
    temperature: float = Field(0.0, **_BOUNDS["temperature"].field())
    top_p: float = Field(1.0, **_BOUNDS["top_p"].field())
    seed: int | None = Field(0, **_BOUNDS["seed"].field())
    stop: list[str] = Field(default_factory=list, description="Strings that end the output: at most "
                            f"{MAX_STOP_STRINGS}, each of 1 to {MAX_STOP_CHARS} characters (a row's own too)")
    ignore_eos: bool = False
    n: int = Field(1, **_BOUNDS["n"].field(), description="Samples per row (vLLM): the row's ``outputs`` list holds "
                   "them all, ``output`` the first; completion tokens count every sample")
    logprobs: int | None = Field(None, **_BOUNDS["logprobs"].field(), description="Log-probabilities per generated "
                                 "token (vLLM): the chosen token's and the top-k candidates' (0: the chosen token's "
                                 "only) in the row's ``logprobs`` column; null: none")
    top_k: int = Field(0, **_BOUNDS["top_k"].field(), description="Sample from the k most likely tokens; 0 or -1: off "
                       "(the engines' row of the capability table says which apply it)")
    min_p: float = Field(0.0, **_BOUNDS["min_p"].field(), description="Drop tokens below this share of the most "
                         "likely token's probability; 0: off")
    repetition_penalty: float = Field(1.0, **_BOUNDS["repetition_penalty"].field(), description="Above 1 discourages "
                                      "tokens already in the prompt or output (vLLM's and transformers' "
                                      "multiplicative penalty); 1: off")
    stop_token_ids: list[int] = Field(default_factory=list, description="Token ids that end the output, besides "
                                      f"the model's end-of-sequence tokens: at most {MAX_STOP_TOKEN_IDS}, each in "
                                      f"{TOKEN_ID} (a row's own, and its prompt_token_ids, too)")
    include_stop_str_in_output: bool = Field(False, description="Keep the stop string that ended an output at its end")
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict, description="Variables of the chat template "
                                                 "(e.g. enable_thinking: false for Qwen3); a row's own are laid over "
                                                 "these. Every engine: the prompts are rendered before the engine. "
                                                 "Each key must be a variable the chat template reads: checked when "
                                                 "the config loads where the template is known (model.chat_template, "
                                                 "a local model folder), else when the model is fetched")
    output_schema: dict | None = Field(None, description="The JSON Schema every output must match: the schema, "
                                       "or a string naming it, a JSON Schema file (./relative to this YAML) or a "
                                       "pydantic model (module:Class), loaded into the schema itself when the "
                                       "config loads")
    guided_decoding: bool | Literal["fallback"] = Field(
        True, description="Decode under output_schema (vLLM, xgrammar); false: outputs are only checked against it; "
        "fallback: decoded freely first (at the plain rate), and only the rows whose output does not match are "
        "decoded again under the schema (one more pass, before output_retries). On vLLM 0.26 a guided step runs "
        "at ~0.5 of a plain one on the H200 (docs/benchmarks.md): for a model that mostly answers in shape, "
        "fallback costs about the plain run plus the misses")
    guided_length_bounds: Literal["grammar", "check"] = Field(
        "grammar", description="Where output_schema's string length bounds (minLength / maxLength) hold: grammar "
        "(decoded under them: every output within them) or check (decoded under the schema without them, then "
        "checked: an output outside them is an invalid_output row, asked again under output_retries). Bounded "
        "strings cost xgrammar ~26x the mask work per token with a 7B tokenizer (bench grammar-cost), work vLLM "
        "fills in parallel: on the H200 the guided rate moved 0.498 -> 0.514 of plain without them (the schema "
        "compiles in 20 ms instead of 889)")
    output_retries: int = Field(0, ge=0, le=5, description="Ask again, with another seed, for a sampled row "
                                "(temperature > 0) whose output does not match output_schema")
    thinking: Literal["auto", "on", "off"] = Field(
        "auto", description="A reasoning model's thinking, through its chat template's switch (enable_thinking or "
        "thinking, the template variables sampling.chat_template_kwargs sets too): auto: the template's default; "
        "on / off: the switch set. off on a model whose template has no switch, or on on one that does not think, "
        "is refused (batch_llm/reasoning.py). A row's own thinking column or chat_template_kwargs wins")
    max_thinking_tokens: int | None = Field(
        None, **_BOUNDS["max_thinking_tokens"].field(), description="vLLM's thinking budget (thinking_token_budget): "
        "after this many thinking tokens the engine writes the end of the thinking and the answer follows. Needs "
        "engine.reasoning_parser. null: none (thinking may use all of max_tokens)")

    # before the type check, so the field holds only the schema itself (a name is loaded here, on assignment too)
    @field_validator("output_schema", mode="before", json_schema_input_type=dict | str | None)
    @classmethod
    def _load_output_schema(cls, v: Any) -> Any:
        from batch_llm.output_schema import check_schema, load_schema

        if isinstance(v, str):
            return check_schema(load_schema(v))
        return check_schema(v) if isinstance(v, dict) else v  # anything else: the dict | None check refuses it

    @field_validator("top_k")
    @classmethod
    def _one_off_value(cls, v: int) -> int:
        return 0 if v == -1 else v  # vLLM's two spellings of "off": one value for the result cache's key

    @field_validator("stop_token_ids")
    @classmethod
    def _token_ids(cls, v: list[int]) -> list[int]:
        if problem := token_ids_problem(v, "stop_token_ids"):
            raise ValueError(problem)
        return v

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables(cls, v: dict[str, Any]) -> dict[str, Any]:
        reserved = sorted(set(v) & RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise ValueError(f"{', '.join(reserved)}: arguments of the tokenizer's apply_chat_template, not "
                             "template variables")
        return v

    @model_validator(mode="after")
    def _one_thinking_switch(self) -> "SamplingConfig":
        both = sorted(set(self.chat_template_kwargs) & set(SWITCH_VARIABLES))
        if both and self.thinking != "auto":
            raise ValueError(f"thinking: {self.thinking} and chat_template_kwargs.{both[0]} both switch thinking; "
                             "set one of them")
        return self

    @field_validator("stop")
    @classmethod
    def _usable_stops(cls, v: list[str]) -> list[str]:
        # every row would be refused for it (row_params): refused once, here
        if problem := stop_problem(v):
            raise ValueError(problem)
        return v

    @model_validator(mode="after")
    def _default_within_cap(self) -> "SamplingConfig":
        if self.max_tokens_cap is not None and self.max_tokens > self.max_tokens_cap:
            raise ValueError(f"max_tokens ({self.max_tokens}) is above max_tokens_cap ({self.max_tokens_cap})")
        return self
