"""A row's own sampling parameters: the fields of an OpenAI Batch request body, or columns of a table.

The pipeline's ``sampling`` section is the default; a row overrides only what it sets. ``sampling.max_tokens``
is the default output limit, and a cap only where ``sampling.max_tokens_cap`` is configured (capped rows are
counted by the planner). A parameter the pipeline or its engine cannot honor is a row error with the reason,
never silently dropped: tools, ``best_of``, ``echo``, a JSON response format; ``n > 1``, log-probabilities and
penalties on engines without them.

    params = RowParams.from_openai_body(body)          # ValueError names what is refused
    sampling = params.resolve(cfg.sampling)            # every field set: what the engine is asked for
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from batch_llm.config import SamplingConfig
from batch_llm.engines.capabilities import ENGINES, who_can

# Body fields that change what is generated and that this pipeline does not do: refused per row (with the
# value that would be ignored), not dropped. Fields absent or at these neutral values are accepted.
_NEUTRAL = {"best_of": (None, 1), "stream": (None, False), "echo": (None, False), "tools": (None, []), "functions": (None, []),
            "tool_choice": (None, "none"), "function_call": (None, "none"), "logit_bias": (None, {}),
            "suffix": (None, ""), "response_format": (None, {"type": "text"})}

# The per-row parameters each engine applies come from its row of the capability table (``row_params``); any
# other set parameter is a row error on that engine.

# Table columns that may carry per-row parameters (``input.sampling_columns`` picks which are read).
COLUMNS = ("max_tokens", "temperature", "top_p", "stop", "seed", "presence_penalty", "frequency_penalty", "n",
           "logprobs")
MAX_LOGPROBS = 20  # vLLM's default max_logprobs, and OpenAI's top_logprobs limit


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

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_openai_body(cls, body: dict, *, completions: bool = False) -> RowParams | None:
        """The parameters of a ``/v1/chat/completions`` body (or a ``/v1/completions`` one: ``completions``);
        ValueError for a field that would change the output and that the pipeline does not do."""
        for name, neutral in _NEUTRAL.items():
            if body.get(name) not in neutral:
                raise ValueError(f"{name}={body[name]!r} is not supported by this batch pipeline "
                                 "(text output, no tools, no echo or best_of)")
        limit = body.get("max_completion_tokens")
        values = {"max_tokens": limit if limit is not None else body.get("max_tokens"),
                  "logprobs": _openai_logprobs(body, completions),
                  **{k: body.get(k) for k in ("temperature", "top_p", "stop", "seed", "presence_penalty",
                                               "frequency_penalty", "n")}}
        return cls.from_values(values)

    @classmethod
    def from_columns(cls, record: dict, columns: list[str]) -> RowParams | None:
        """The parameters a table row carries in the configured columns (empty cells are unset)."""
        return cls.from_values({c: record.get(c) for c in columns})

    @classmethod
    def from_values(cls, values: dict) -> RowParams | None:
        out = {}
        for name, v in values.items():
            if v is None or (isinstance(v, float) and v != v) or v == "":  # unset, NaN or an empty CSV cell
                continue
            out[name] = _check(name, v)
        return cls(**out) if out else None

    @classmethod
    def from_json(cls, d: dict | None) -> RowParams | None:
        if not d:
            return None
        return cls(**{k: (tuple(v) if k == "stop" else v) for k, v in d.items()})

    # ------------------------------------------------------------------ use
    def to_json(self) -> dict:
        """Only the fields the row sets (what shard rows, spools and cache keys carry)."""
        return {k: (list(v) if k == "stop" else v) for k, v in asdict(self).items() if v is not None}

    def set_names(self) -> set[str]:
        return {f.name for f in fields(self) if getattr(self, f.name) is not None}

    def resolve(self, s: SamplingConfig) -> Sampling:
        return resolve(self, s)

    def capped(self, cap: int | None) -> tuple[RowParams, bool]:
        """(these parameters with max_tokens at most ``cap``, whether it was lowered)."""
        if cap is None or self.max_tokens is None or self.max_tokens <= cap:
            return self, False
        return RowParams(**{**asdict(self), "max_tokens": cap}), True


def resolve(p: RowParams | None, s: SamplingConfig) -> Sampling:
    """The request's full sampling: the row's values where it sets them, else the pipeline's."""
    def pick(name, default):
        v = getattr(p, name) if p is not None else None
        return default if v is None else v

    return Sampling(max_tokens=pick("max_tokens", s.max_tokens), temperature=pick("temperature", s.temperature),
                    top_p=pick("top_p", s.top_p), stop=pick("stop", tuple(s.stop)), seed=pick("seed", s.seed),
                    ignore_eos=s.ignore_eos, presence_penalty=pick("presence_penalty", 0.0),
                    frequency_penalty=pick("frequency_penalty", 0.0), n=pick("n", s.n),
                    logprobs=pick("logprobs", s.logprobs))


def _openai_logprobs(body: dict, completions: bool):
    """The top-k a body asks for, or None. Chat bodies say ``logprobs: true`` (+ ``top_logprobs: k``, 0 when
    absent); completions bodies give k as ``logprobs`` itself, as OpenAI's two endpoints do."""
    lp, top = body.get("logprobs"), body.get("top_logprobs")
    if completions:
        if top is not None:
            raise ValueError("top_logprobs is a chat field; a /v1/completions body gives k as logprobs")
        return None if lp is None or lp is False else lp  # False: as absent; True/other types: _check says
    if lp not in (None, False, True):
        raise ValueError(f"logprobs must be true or false in a chat body (top_logprobs gives k), got {lp!r}")
    if lp is not True:
        if top not in (None, 0):
            raise ValueError(f"top_logprobs={top!r} needs logprobs: true")
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
    if name in ("max_tokens", "seed", "n", "logprobs"):
        return _check_int(name, v)
    if name == "stop":
        stops = [v] if isinstance(v, str) else v
        if not isinstance(stops, list) or not all(isinstance(x, str) and x for x in stops):
            raise ValueError(f"stop must be a string or a list of strings, got {v!r}")
        return tuple(stops)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{name} must be a number, got {v!r}")
    v = float(v)
    bounds = {"temperature": (0.0, 2.0), "top_p": (0.0, 1.0), "presence_penalty": (-2.0, 2.0),
              "frequency_penalty": (-2.0, 2.0)}[name]
    if not bounds[0] <= v <= bounds[1] or (name == "top_p" and v == 0):
        raise ValueError(f"{name} must be in {'(' if name == 'top_p' else '['}{bounds[0]}, {bounds[1]}], got {v}")
    return v


_INT_RANGE = {"max_tokens": (1, None), "seed": (None, None), "n": (1, 128), "logprobs": (0, MAX_LOGPROBS)}


def _check_int(name: str, v):
    if isinstance(v, float) and v.is_integer():  # a Parquet/CSV integer column with gaps is float
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        kind = "a positive integer" if name in ("max_tokens", "n") else "an integer"
        raise ValueError(f"{name} must be {kind}, got {v!r}")
    lo, hi = _INT_RANGE[name]
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        if name == "max_tokens":
            raise ValueError(f"max_tokens must be a positive integer, got {v!r}")
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {v}")
    return v
