"""What a shard commits for a request's rows: result rows (the sample, embedding, class and reasoning fields a
result carries), error rows, and outputs that miss their schema (``sampling.output_schema`` or a row's own
response_format), kept as rows of their own kind or asked again (``OutputChecks``)."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path

from batch_llm.config import PipelineConfig
from batch_llm.engines.base import Engine, GenRequest, GenResult
from batch_llm.output_schema import OutputSchema
from batch_llm.rows.params import RowParams, resolve, response_schema
from batch_llm.stages.infer.request_builder import RequestSpool

# A result's fields beyond the first sample, present only where the request asked for them: every sample's
# text and finish reason (n > 1), the log-probabilities of the first sample's tokens and of every sample's.
# Chunks, outputs.jsonl and cache entries carry them as they are, so a resumed shard or a cache hit loses none.
SAMPLE_FIELDS = ("outputs", "finish_reasons", "logprobs", "outputs_logprobs")
# engine.task embed: the row's vector; classify: its top class and every class's probability. Carried like the
# sample fields (chunks, outputs.jsonl, cache entries).
# A reasoning model's thinking, parted from the answer by the engine's reasoning parser (engine.reasoning_parser):
# the first sample's thinking, its tokens (every sample's), whether it ended, the budget it ran under, and every
# sample's thinking (n > 1). Carried like the sample fields.
REASONING_FIELDS = ("reasoning", "reasoning_tokens", "thinking_ended", "max_thinking_tokens", "outputs_reasoning")
# What ended the output where a stop string or stop token did (vLLM's stop_reason: the string or the token id),
# the first sample's and every sample's (n > 1); absent where the engine said none (EOS, length, other engines).
STOP_FIELDS = ("stop_reason", "stop_reasons")
RESULT_FIELDS = (*SAMPLE_FIELDS, "embedding", "label", "scores", *REASONING_FIELDS, *STOP_FIELDS)


def sample_fields(res: GenResult) -> dict:
    """The result's ``SAMPLE_FIELDS`` (JSON-ready): ``outputs`` / ``finish_reasons`` where it has several
    samples, ``logprobs`` (the first sample's, as ``output`` is the first's) and ``outputs_logprobs`` where
    log-probabilities were asked for."""
    samples = res.samples or ()
    out: dict = {}
    if len(samples) > 1:
        out["outputs"] = [s.text for s in samples]
        out["finish_reasons"] = [s.finish_reason for s in samples]
    if samples and samples[0].logprobs is not None:
        out["logprobs"] = [dataclasses.asdict(t) for t in samples[0].logprobs]
        if len(samples) > 1:
            out["outputs_logprobs"] = [[dataclasses.asdict(t) for t in s.logprobs or ()] for s in samples]
    return out


def _reasoning_fields(res: GenResult) -> dict:
    """The result's ``REASONING_FIELDS``, where the engine parted thinking from answer (none otherwise)."""
    if res.thinking_ended is None:
        return {}
    out: dict = {"reasoning": res.reasoning, "reasoning_tokens": res.reasoning_tokens,
                 "thinking_ended": res.thinking_ended}
    if res.thinking_budget is not None:
        out["max_thinking_tokens"] = res.thinking_budget
    if res.samples and len(res.samples) > 1:
        out["outputs_reasoning"] = [s.reasoning for s in res.samples]
    return out


def _stop_fields(res: GenResult) -> dict:
    """The result's ``STOP_FIELDS``, where a stop string or stop token ended a sample (none otherwise)."""
    samples = res.samples or ()
    out: dict = {}
    if res.stop_reason is not None:
        out["stop_reason"] = res.stop_reason
    if len(samples) > 1 and any(s.stop_reason is not None for s in samples):
        out["stop_reasons"] = [s.stop_reason for s in samples]
    return out


def unfinished_thinking(res: GenResult) -> str | None:
    """Why a row under a schema has no answer to check: its thinking never ended (the grammar waits for the end
    of the thinking, so nothing was decoded under it); None where it ended or there was none."""
    if res.thinking_ended is not False:
        return None
    return (f"thinking never ended: {res.reasoning_tokens} thinking tokens ran to the end of the output "
            f"(finish_reason {res.finish_reason}) before an answer under the schema began; raise max_tokens or set "
            "sampling.max_thinking_tokens")


def result_row(r: tuple[str, int], entry: dict, *, cached: bool, key: str) -> dict:
    return {"id": r[0], "idx": r[1], "output": entry["output"], "finish_reason": entry["finish_reason"],
            "prompt_tokens": entry["prompt_tokens"], "completion_tokens": entry["completion_tokens"],
            "cached_prompt_tokens": 0 if cached else entry.get("cached_prompt_tokens", 0),
            "cached": cached, "error": None, "key": key, **{k: entry[k] for k in RESULT_FIELDS if k in entry}}


def error_row(r: tuple[str, int], reason: str, prompt_tokens: int = 0) -> dict:
    return {"id": r[0], "idx": r[1], "output": None, "finish_reason": None, "prompt_tokens": prompt_tokens,
            "completion_tokens": 0, "cached": False, "error": reason}


def _invalid_row(r: tuple[str, int], res: GenResult, reason: str) -> dict:
    """An output that does not match ``sampling.output_schema``: kept (with its text) as an error row of its
    own kind, which ``engine.max_error_rate`` does not count: the engine worked, the answer did not fit."""
    return {"id": r[0], "idx": r[1], "output": res.text, "finish_reason": res.finish_reason,
            "prompt_tokens": res.prompt_tokens, "completion_tokens": res.completion_tokens,
            "cached_prompt_tokens": res.cached_prompt_tokens, "cached": False,
            "error": reason, "error_kind": "invalid_output", **sample_fields(res), **_reasoning_fields(res),
            **_stop_fields(res)}


# Off: in a clean-clone CI run, the engine thread's first import of vLLM (transformers, accelerate) raced the
# main thread's tokenizer import ("cannot import name 'AlignDevicesHook' from partially initialized module
# 'accelerate.hooks'"), which broke every later engine start in that process. The engine then starts first,

def result_rows(res: GenResult, rows: list[tuple[str, int]], key: str, reason: str | None) -> list[dict]:
    """The rows (id, idx) one result answers, as committed: an error row where the engine failed the request, an
    invalid-output row where ``reason`` says why the output misses its schema, else a result row (``key``: the
    request's content key, the cache's)."""
    entry = {"output": res.text, "finish_reason": res.finish_reason, "prompt_tokens": res.prompt_tokens,
             "completion_tokens": res.completion_tokens, "cached_prompt_tokens": res.cached_prompt_tokens,
             **sample_fields(res), **_reasoning_fields(res), **_stop_fields(res)}
    if res.embedding is not None:  # a vector, no text: output stays null
        entry.update(output=None, embedding=res.embedding)
    if res.scores is not None:  # class probabilities, no text: output stays null
        entry.update(output=None, label=max(res.scores, key=res.scores.__getitem__), scores=res.scores)
    out = []
    for r in rows:
        if res.error:
            out.append(error_row(r, res.error, prompt_tokens=res.prompt_tokens))
        elif reason:
            out.append(_invalid_row(r, res, reason))
        else:
            out.append(result_row(r, entry, cached=False, key=key))
    return out


def cache_entries(rows: Iterator[dict]) -> Iterator[dict]:
    """A shard's output rows that the engine generated, as result-cache entries (the fields a hit gives back)."""
    return ({k: r[k] for k in ("key", "output", "finish_reason", "prompt_tokens", "completion_tokens", *RESULT_FIELDS)
             if k in r} for r in rows if not r["cached"] and r.get("key"))


class OutputChecks:
    """The schema each request's output must match, and the outputs asked again where they miss it: the requests
    in flight that may be (``retryable``) and those to ask again once the pass is through (``retry``, a spool on
    local disk)."""

    def __init__(self, cfg: PipelineConfig):
        self.cfg = cfg
        schema = cfg.sampling.output_schema
        self.schema = OutputSchema(schema) if schema is not None else None
        self.row_formats: dict[str, str] = {}  # request_id -> its row's own response_format (OpenAI bodies)
        self._row_schemas: dict[str, OutputSchema] = {}  # response_format -> its compiled schema
        self.retryable: dict[str, GenRequest] = {}  # in flight, kept while an invalid output may be asked again
        self.retry: RequestSpool | None = None   # invalid outputs to ask again (on local disk, not in memory)
        self.n_retried = 0
        # guided_decoding: fallback: the first pass decodes freely, the misses once more under the schema
        self.fallback = self.schema is not None and cfg.sampling.guided_decoding == "fallback"

    def note_format(self, request_id: str, params: dict | None) -> None:
        """A row's own response_format (``params``: the shard row's parameters), which its request's output must
        match instead of sampling.output_schema."""
        if params and params.get("response_format"):
            own = RowParams.from_json(params)  # its response_format as canonical JSON text
            if own is not None and own.response_format is not None:
                self.row_formats[request_id] = own.response_format

    def ask_again(self, engine: Engine, spool_dir: Path, with_images: Callable[[GenRequest], GenRequest | None],
                  say: Callable[[str], None]) -> Iterator[tuple[GenResult, bool]]:
        """The passes that ask again for the invalid outputs spooled in ``retry`` (``sampling.output_retries``, one
        more under guided_decoding: fallback): each result, and whether its pass is the last (its output is
        final then). A pass's misses are spooled for the next one as its results are taken."""
        assert self.retry is not None  # the first pass's spool
        attempts = self.cfg.sampling.output_retries + self.fallback
        for attempt in range(1, attempts + 1):
            if not self.retry.count:
                break
            again, self.retry = self.retry.close(), RequestSpool(spool_dir / f"retry-{attempt}.jsonl")
            self.n_retried += again.count
            say(f"asking again for {again.count} invalid outputs (attempt {attempt + 1}"
                f"{', under the schema' if self.fallback else ''})")
            for res in engine.generate(self.retry_requests(again.read(), attempt, with_images)):
                yield res, attempt == attempts

    def sent(self, req: GenRequest) -> None:
        """A request on its way to the engine: kept (by reference: an asked-again request loads its images again)
        where its output may be asked again."""
        if self.may_retry(req):
            self.retryable[req.key] = req

    def verdict(self, res: GenResult, *, last: bool = False) -> tuple[bool, str | None]:
        """Whether the result is asked again (its request spooled for the next pass; its rows stay open) and why
        its output misses its schema (None where it matches or has none)."""
        reason = None
        schema = self.schema_of(res.key)
        if schema is not None and not res.error:
            reason = unfinished_thinking(res) or self.schema_problem(res, schema)
        req = self.retryable.pop(res.key, None)
        if reason and req is not None and not last:
            assert self.retry is not None  # req is retryable: only the generate step fills that, holding the spool
            self.retry.add(req)  # asked again once the first pass is through; the group stays open
            return True, reason
        return False, reason

    def may_retry(self, req: GenRequest) -> bool:
        """An invalid output is asked again where that can change it: under guided_decoding: fallback every row
        (its first pass was free), otherwise a sampled row (another seed) under output_retries."""
        return self.fallback or (self.schema_of(req.key) is not None and self.cfg.sampling.output_retries > 0
                                 and resolve(req.params, self.cfg.sampling).temperature > 0)

    def schema_of(self, request_id: str) -> OutputSchema | None:
        """The schema a request's output must match: its row's response_format, else sampling.output_schema."""
        rf = self.row_formats.get(request_id)
        if rf is None:
            return self.schema
        if rf not in self._row_schemas:
            self._row_schemas[rf] = OutputSchema(response_schema(rf))
        return self._row_schemas[rf]

    def schema_problem(self, res: GenResult, schema: OutputSchema) -> str | None:
        """Why the output does not match the schema, or None; with n > 1 every sample must match (the first
        one that does not is named)."""
        texts = [s.text for s in res.samples] if res.samples and len(res.samples) > 1 else [res.text]
        for i, text in enumerate(texts):
            _, reason = schema.check(text)
            if reason:
                return reason if len(texts) == 1 else f"{reason} (sample {i})"
        return None

    def retry_requests(self, requests: Iterator[GenRequest], attempt: int,
                       with_images: Callable[[GenRequest], GenRequest | None]) -> Iterator[GenRequest]:
        """The requests asked again on this attempt, each under a seed of its own (under the schema with
        guided_decoding: fallback), its images loaded again (``with_images``: None where they cannot be)."""
        for req in requests:
            s = resolve(req.params, self.cfg.sampling)
            seed = (s.seed or 0) + 1_000_003 * attempt
            again = dataclasses.replace(req, params=dataclasses.replace(req.params or RowParams(), seed=seed),
                                        guided=True if self.fallback else req.guided)
            if not (self.fallback and s.temperature == 0):  # a greedy row under the schema is final
                self.retryable[req.key] = again
            loaded = with_images(again)
            if loaded is None:
                self.retryable.pop(req.key, None)
                continue
            yield loaded
