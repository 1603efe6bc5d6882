"""Every copy of generated text a result row holds, and the one way to mask them.

A generate row carries what the model wrote in several places, per sample (``sampling.n``):

- the answer: ``output`` (the first sample), every sample's in ``outputs`` (n > 1);
- a reasoning model's thinking: ``reasoning``, every sample's in ``outputs_reasoning``;
- the token log-probabilities: ``logprobs`` (the first sample's), every sample's in ``outputs_logprobs``: each
  chosen token's text, the whole generation (the thinking, its ``</think>`` and the answer), and the top
  alternatives at each place, which may spell what was not chosen.

The first sample is in two places each (``output`` and ``outputs[0]``, ...). The content filter scans what
``copies`` yields and both the word lists and the review mask through ``masked``, which writes each sample's masked
text to every place it is in: no copy is scanned, masked or published apart from the others. A field of generated
text the published rows carry (``rows.records``) that is not read here would be published unscanned;
tests/unit/test_masking_every_copy.py holds the two in step.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

# Each copy's field, the field that holds every sample's (n > 1), in the order they are scanned
SAMPLED = {"output": "outputs", "reasoning": "outputs_reasoning", "logprobs": "outputs_logprobs"}
# An alternative at a token's place (``logprobs[i].top[j]``): a copy of its own, scanned on its own
ALTERNATIVE = "top_logprobs"
# What the rows carry of generated text, each place: what rows.records may publish is checked against it
TEXT_FIELDS = (*SAMPLED, *SAMPLED.values())


@dataclass(frozen=True)
class Copy:
    """One copy of a sample's text: ``field`` (``output``, ``reasoning``, ``logprobs``: the chosen tokens joined,
    ``top_logprobs``: the alternatives, one a line), the sample and its text."""

    field: str
    sample: int
    text: str

    @property
    def key(self) -> tuple[str, int]:
        return self.field, self.sample


# What to mask: per copy (its ``key``), the (start, end) character spans in its text
Spans = dict[tuple[str, int], list[tuple[int, int]]]
# Between two alternatives in their copy: a line break, which no listed word holds and no fold reads past
# (stages.confusables keeps line breaks), so each is read on its own in one pass over them all
_ALT_SEP = "\n"


def sample_count(row: dict) -> int:
    """How many samples the row holds (``outputs`` where n > 1, else one)."""
    samples = row.get("outputs")
    return len(samples) if isinstance(samples, list) and samples else 1


def _value(row: dict, field: str, sample: int):
    every = row.get(SAMPLED[field])
    if isinstance(every, list) and every:
        return every[sample] if sample < len(every) else None
    return row.get(field) if sample == 0 else None


def text_of(row: dict, field: str, sample: int) -> str:
    """A sample's answer (``output``) or thinking (``reasoning``); "" where it has none."""
    value = _value(row, field, sample)
    return value if isinstance(value, str) else ""


def tokens_of(row: dict, sample: int) -> list[dict] | None:
    """A sample's token log-probabilities (``{"token", "logprob", "top": [{"token", "logprob"}]}`` each)."""
    value = _value(row, "logprobs", sample)
    return value if isinstance(value, list) else None


def copies(row: dict) -> Iterator[Copy]:
    """Every copy of generated text in the row, each sample's in turn: answer, thinking, chosen tokens joined,
    its alternatives."""
    for k in range(sample_count(row)):
        for field in ("output", "reasoning"):
            if text := text_of(row, field, k):
                yield Copy(field, k, text)
        tokens = tokens_of(row, k)
        if not tokens:
            continue
        chosen, alternatives = _joined(tokens)
        yield Copy("logprobs", k, chosen)
        if alternatives:
            yield Copy(ALTERNATIVE, k, alternatives)


def alternative_at(row: dict, sample: int, offset: int) -> tuple[int, int, int]:
    """(token place, rank, offset in that alternative) of an offset into a sample's ``top_logprobs`` copy."""
    at = 0
    for i, j, text in _alternatives(tokens_of(row, sample) or []):
        if offset < at + len(text):
            return i, j, offset - at
        at += len(text) + len(_ALT_SEP)
    raise ValueError(f"offset {offset} is past sample {sample}'s alternatives")


def _token_text(t: dict) -> str:
    text = t.get("token")
    return text if isinstance(text, str) else ""


def _joined(tokens: list[dict]) -> tuple[str, str]:
    """(the chosen tokens joined, the alternatives joined a line each): every row with log-probabilities pays this,
    so the tokens as the shards write them take one comprehension each; any other shape goes the careful way."""
    try:
        return ("".join([t["token"] for t in tokens]),
                _ALT_SEP.join([a for t in tokens for c in t["top"] if (a := c["token"]) and a != t["token"]]))
    except (KeyError, TypeError):
        return "".join(_token_text(t) for t in tokens), _ALT_SEP.join(text for _, _, text in _alternatives(tokens))


def _alternatives(tokens: list[dict]) -> list[tuple[int, int, str]]:
    """(place, rank, text) of each alternative but the chosen token itself (read in the joined tokens, with its
    neighbours) and empty ones, in the order ``_joined`` joins them: where a hit in that copy is."""
    return [(i, j, text) for i, t in enumerate(tokens) for j, alt in enumerate(t.get("top") or ())
            if (text := _token_text(alt)) and text != _token_text(t)]


def whole(row: dict, samples: set[int] | None = None) -> Spans:
    """Spans covering every copy of the given samples (None: all): what a mask of the whole sample hides."""
    return {c.key: [(0, len(c.text))] for c in copies(row) if samples is None or c.sample in samples}


def _mask(text: str, spans: list[tuple[int, int]], mask_char: str) -> str:
    chars = list(text)
    for start, end in spans:
        start, end = max(start, 0), min(end, len(text))
        chars[start:end] = mask_char * max(end - start, 0)
    return "".join(chars)


def masked(row: dict, spans: Spans, mask_char: str) -> dict:
    """The row with ``spans`` masked in every place each copy is in (a sample's first, ``output`` and
    ``outputs[0]``, alike). Tokens are masked character by character in the joined text and split back, their
    log-probabilities kept; every alternative at the place of a token with a masked character is masked whole
    (the chosen token is among them, and the others are what the model nearly wrote there). The row is copied;
    an empty ``spans`` returns it as it is."""
    if not any(spans.values()):
        return row
    out = dict(row)
    for k in range(sample_count(row)):
        for field in ("output", "reasoning"):
            if spans.get((field, k)):
                _put(out, field, k, _mask(text_of(row, field, k), spans[(field, k)], mask_char))
        tokens = tokens_of(row, k)
        if tokens and (spans.get(("logprobs", k)) or spans.get((ALTERNATIVE, k))):
            _put(out, "logprobs", k, _masked_tokens(tokens, spans.get(("logprobs", k), []),
                                                    spans.get((ALTERNATIVE, k), []), mask_char))
    return out


def _masked_tokens(tokens: list[dict], chosen: list[tuple[int, int]], alternatives: list[tuple[int, int]],
                   mask_char: str) -> list[dict]:
    texts = [_token_text(t) for t in tokens]
    joined = _mask("".join(texts), chosen, mask_char)
    alt_text = {}  # (place, rank) -> the alternative, masked where a hit in it is
    at = 0
    for i, j, text in _alternatives(tokens):
        alt_text[(i, j)] = _mask(text, [(s - at, e - at) for s, e in alternatives if s < at + len(text) and e > at],
                                 mask_char)
        at += len(text) + len(_ALT_SEP)
    result, at = [], 0
    for i, (t, text) in enumerate(zip(tokens, texts, strict=True)):
        hidden = any(start < at + len(text) and end > at for start, end in chosen)
        top = [{**alt, "token": mask_char * len(_token_text(alt)) if hidden else
                alt_text.get((i, j), _token_text(alt))} for j, alt in enumerate(t.get("top") or ())]
        result.append({**t, "token": joined[at:at + len(text)], **({"top": top} if "top" in t else {})})
        at += len(text)
    return result


def _put(out: dict, field: str, sample: int, value) -> None:
    """A sample's masked copy in every place it is: the sample list and, for the first, the field itself."""
    every = out.get(SAMPLED[field])
    if isinstance(every, list) and every:
        every = out[SAMPLED[field]] = list(every)
        if sample < len(every):
            every[sample] = value
    if sample == 0 and field in out:
        out[field] = value
