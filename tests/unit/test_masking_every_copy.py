"""Masked text is masked in every copy of it a row holds and a sink writes: the answer of every sample, the
thinking, the log-probabilities' tokens and their alternatives (``batch_llm.generated_text``). The word lists
read each copy (the tokens too, and a word around ``</think>``); a mask, the lists' or the review's, hides it in
all of them, in every published format (JSONL, CSV, Parquet, the tables' rows, OpenAI Batch output lines)."""
from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from batch_llm import generated_text
from batch_llm.config import FilterConfig, ReviewConfig, WordListConfig
from batch_llm.io import formats
from batch_llm.io.storage import Location
from batch_llm.rows import records
from batch_llm.stages import review as rv
from batch_llm.stages.content_filter import ContentFilter

GUARD = {"ref": "/models/guard"}


def _tokens(*pieces: str, alternatives: dict[int, list[str]] | None = None) -> list[dict]:
    """Token log-probabilities as the shards write them; each token its own first alternative, as vLLM gives."""
    alternatives = alternatives or {}
    return [{"token": p, "logprob": -0.5, "top": [{"token": t, "logprob": -0.5 - r}
                                                 for r, t in enumerate([p, *alternatives.get(i, [])])]}
            for i, p in enumerate(pieces)]


def _row_of_two_samples() -> dict:
    """A reasoning model's row of two samples with log-probabilities, every copy of its text holding a secret."""
    first = ("<think>", "Plan", " SECRETPLAN", "</think>", "SECRET", "ANSWER", " here")
    second = ("<think>", "Other", " SECRETOTHER", "</think>", "SECRET", "SAMPLE")
    lp = [_tokens(*first, alternatives={5: ["SECRETALT"]}), _tokens(*second)]
    return {"id": "x", "idx": 0, "output": "SECRETANSWER here", "outputs": ["SECRETANSWER here", "SECRETSAMPLE"],
            "finish_reasons": ["stop", "stop"], "reasoning": "Plan SECRETPLAN",
            "outputs_reasoning": ["Plan SECRETPLAN", "Other SECRETOTHER"], "reasoning_tokens": 3,
            "thinking_ended": True, "logprobs": lp[0], "outputs_logprobs": lp, "error": None,
            "finish_reason": "stop", "prompt_tokens": 4, "completion_tokens": 7, "cached": False}


def _reviewed(row: dict, unsafe: list[int]) -> dict:
    """The row after the review's verdicts: its samples in ``unsafe`` unsafe, of a category the review masks."""
    r = ReviewConfig(model=GUARD, categories=["privacy"], actions={"privacy": "mask"})
    verdicts = [{"id": rv.request_id(row["id"], k), "idx": row["idx"] * rv.SAMPLE_SLOTS + k,
                 "output": json.dumps({"verdict": "unsafe" if k in unsafe else "safe",
                                       "categories": ["privacy"] if k in unsafe else []})}
                for k in range(generated_text.sample_count(row))]
    out, dropped = rv.ReviewedRows(r, iter(verdicts)).take(row)
    assert dropped is None and out is not None and out["review_verdict"] == "unsafe"
    return out


def _published(tmp_path, row: dict) -> str:
    """Everything every sink writes of the row, as text: the JSONL, CSV and Parquet files, a table's row (the
    Parquet record) and the OpenAI Batch output lines of a chat and of a completions request."""
    record = {"id": row["id"], "prompt": "q"}
    texts = []
    for fmt in ("jsonl", "csv", "parquet"):
        path = Location(str(tmp_path / f"data.{fmt}")).path()
        formats.write_rows(path, [records.output_record(record, row, fmt)], fmt)
        texts.append(json.dumps(pq.read_table(str(path)).to_pylist()) if fmt == "parquet" else
                     path.read_text(encoding="utf-8"))
    for url in ("/v1/chat/completions", "/v1/completions"):
        line = records.output_record({"custom_id": "x", "url": url, "body": {}}, row, "openai_batch")
        texts.append(json.dumps(line, ensure_ascii=False))
    return "\n".join(texts)


def test_a_review_mask_publishes_nothing_of_the_sample_in_any_format(tmp_path):
    """An unsafe verdict whose action is mask: the answer, the thinking, every token and alternative of the
    unsafe samples are masked wherever the row keeps them, so no sink format carries any of their text; the
    log-probabilities stay, one per token."""
    row = _row_of_two_samples()
    assert "SECRETPLAN" in _published(tmp_path, row)  # every copy is published as generated
    out = _reviewed(row, unsafe=[0, 1])
    published = _published(tmp_path, out)
    assert "SECRET" not in published and "Plan" not in published and "here" not in published
    assert out["output"] == out["outputs"][0] == "*" * len("SECRETANSWER here")
    assert out["reasoning"] == out["outputs_reasoning"][0] == "*" * len("Plan SECRETPLAN")
    assert out["logprobs"] == out["outputs_logprobs"][0] and len(out["logprobs"]) == 7
    assert [t["logprob"] for t in out["logprobs"]] == [t["logprob"] for t in row["logprobs"]]


def test_a_review_mask_of_one_sample_leaves_the_others(tmp_path):
    """Only the unsafe sample is masked, in every copy of it; the safe sample's answer, thinking and tokens stay."""
    out = _reviewed(_row_of_two_samples(), unsafe=[1])
    published = _published(tmp_path, out)
    assert "SECRETOTHER" not in published and "SECRETSAMPLE" not in published
    assert out["output"] == "SECRETANSWER here" and out["reasoning"] == "Plan SECRETPLAN"
    assert out["outputs_logprobs"][0] == out["logprobs"] == _row_of_two_samples()["logprobs"]
    assert out["outputs_reasoning"][1] == "*" * len("Other SECRETOTHER")
    assert {t["token"] for t in out["outputs_logprobs"][1]} <= {"*" * n for n in range(20)}


def _filter(tmp_path, action: str = "mask", **list_settings) -> ContentFilter:
    (tmp_path / "words.txt").write_text("badword\n", encoding="utf-8")
    return ContentFilter(FilterConfig(lists=[WordListConfig(name="w", path=str(tmp_path / "words.txt"),
                                                            action=action, **list_settings)]))


def test_a_word_in_the_thinking_only_is_masked_in_the_tokens_too(tmp_path):
    """A listed word the thinking holds (not the answer) is a hit in the thinking and in the tokens, and masked in
    both; the tokens around it and the thinking's end marker stay readable."""
    row = {"id": "r", "idx": 0, "output": "fine", "reasoning": "a badword here",
           "logprobs": _tokens("<think>", "a", " bad", "word", " here", "</think>", "fine")}
    out, hits = _filter(tmp_path).apply(row)
    assert {h.get("field") for h in hits} == {"reasoning", "logprobs"}
    assert out["reasoning"] == "a ******* here" and out["output"] == "fine"
    assert [t["token"] for t in out["logprobs"]] == ["<think>", "a", " ***", "****", " here", "</think>", "fine"]
    assert all(c["token"] == "*" * len(c["token"]) for t in out["logprobs"][2:4] for c in t["top"])
    assert "bad" not in json.dumps(out)  # nor in the published hits: a mask hit names no word
    assert hits[0]["word"] == "badword" and "word" not in out["filter_hits"][0]  # the summary counts the word


def test_a_word_in_the_logprob_tokens_only_is_found(tmp_path):
    """A listed word that only an alternative holds (a token the model nearly wrote) is a hit at its place:
    masked there under mask, the row dropped under drop."""
    row = {"id": "r", "idx": 0, "output": "a fine day",
           "logprobs": _tokens("a", " fine", " day", alternatives={1: [" badword", " nice"]})}
    out, hits = _filter(tmp_path).apply(row)
    assert [(h["field"], h["place"], h["start"], h["end"]) for h in hits] == [("top_logprobs", [1, 1], 1, 8)]
    assert [c["token"] for c in out["logprobs"][1]["top"]] == [" fine", " *******", " nice"]
    assert out["output"] == "a fine day" and [t["token"] for t in out["logprobs"]] == ["a", " fine", " day"]
    assert _filter(tmp_path, action="drop").apply(row)[0] is None


@pytest.mark.parametrize("scan", [["output", "reasoning"], ["output"]])
def test_a_word_split_across_the_end_of_the_thinking_is_found(tmp_path, scan):
    """A word whose first part ends the thinking and whose rest begins the answer (neither field alone holds it)
    is a hit in the tokens, which read past ``</think>``, and in the thinking and answer read as one: masked in
    all three, the marker left as it is."""
    row = {"id": "r", "idx": 0, "reasoning": "so bad", "output": "word is it",
           "logprobs": _tokens("<think>", "so", " bad", "</think>", "word", " is", " it")}
    out, hits = _filter(tmp_path, scan=scan).apply(row)
    assert sorted(h["field"] for h in hits) == ["logprobs", "reasoning+output"]
    assert (out["reasoning"], out["output"]) == ("so ***", "**** is it")
    assert [t["token"] for t in out["logprobs"]] == ["<think>", "so", " ***", "</think>", "****", " is", " it"]
    assert _filter(tmp_path, action="drop").apply(row)[0] is None
    for before, end in (("x " * 200, "so bad"), ("é " * 200, "so b\u200bad")):  # near its end (ASCII), or whole
        long = {"id": "r", "idx": 0, "reasoning": before + end, "output": "word"}
        out, (hit,) = _filter(tmp_path).apply(long)
        assert (out["reasoning"], out["output"]) == (before + "so " + "*" * (len(end) - 3), "****")
        assert (hit["start"], hit["end"]) == (len(before) + 3, len(before + end) + len("</think>") + 4)
    raw = {"id": "r", "idx": 0, "output": "<think>so bad</think>word is it"}  # no reasoning parser: one field
    assert _filter(tmp_path).apply(raw)[0]["output"] == "<think>so ***</think>**** is it"


def test_every_published_field_of_generated_text_is_one_the_masking_reads():
    """The published rows' generated fields that hold the model's text are the ones ``generated_text`` scans and
    masks: a new one must be added there (or here, as no text) before it is published."""
    no_text = {"finish_reason", "prompt_tokens", "cached_prompt_tokens", "completion_tokens", "filter_hits", "error",
               "finish_reasons", "embedding", "label", "scores", "review_verdict", "review_categories",
               "review_error", "reasoning_tokens", "thinking_ended", "max_thinking_tokens"}
    assert set(records._GENERATED) - no_text == set(generated_text.TEXT_FIELDS)
