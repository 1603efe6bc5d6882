"""engine.task classify on the real CPU vLLM engine (pooling runner), through ``batch-llm run``.

The demo model is a causal LM, so it classifies zero-shot: ``engine.classify.labels`` makes vLLM's score head the
language-model head's rows of the label tokens, and a row's class probabilities are the softmax of those
tokens' logits at the prompt's last position (the chat template's assistant turn). One engine start for the
module: 24 English product reviews (a Parquet table with a gold ``label`` column) through plan -> infer ->
filter -> evaluate -> publish. The published table holds the prediction (``output_label``, as the input has a
``label``) and one float64 ``score_<class>`` column per class; the scores are checked against transformers'
own forward pass of the same model over the same prompts, computed here independently of vLLM.
"""
from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from batch_llm.engines.base import EngineCannotRun
from batch_llm.engines.vllm_engine import classify_labels
from batch_llm.io.storage import Location
from helpers import run_demo_cli

DS = "2026-12-02"
LABELS = ["positive", "negative", "neutral"]
SYSTEM = "Classify the sentiment of the product review. Answer with one word: positive, negative or neutral."
REVIEWS = {
    "positive": ["I love this phone, the battery lasts for days!", "Excellent quality, works perfectly. Highly "
                 "recommended.", "Best purchase I made this year, fantastic sound.", "Great value and super fast "
                 "delivery, very happy.", "Wonderful blender, smoothies are perfect every time.", "Amazing camera, "
                 "the photos look stunning.", "Comfortable shoes, I wear them every day and love them.",
                 "The kids adore this toy, great fun and well made."],
    "negative": ["Terrible. It broke after one day.", "Awful quality, the screen cracked immediately. Waste of "
                 "money.", "Worst headphones ever, the sound is horrible.", "It stopped working after a week, very "
                 "disappointed.", "The charger overheats and smells burnt. Dangerous.", "Rude support and the "
                 "refund never came. Avoid.", "Cheap plastic, fell apart on the first use.", "Arrived damaged and "
                 "it does not turn on at all."],
    "neutral": ["It is a phone.", "The box contains a cable and a manual.", "The package arrived on Tuesday.",
                "It is blue and about ten centimetres long.", "The item matches the description.", "I have used it "
                "twice so far.", "It comes in three sizes.", "The manual is written in English and French."],
}
ROWS = [{"id": f"{gold[:3]}{i}", "review": text, "label": gold}
        for gold, texts in REVIEWS.items() for i, text in enumerate(texts)]
SETS = ["sharding.num_shards=1", "engine.task=classify", f"engine.classify.labels=[{', '.join(LABELS)}]",
        "input.template='{review}'", f'input.system_prompt="{SYSTEM}"', "engine.commit_every_rows=8"]


@pytest.fixture(scope="module")
def run(tmp_path_factory, demo_model_dir):
    tmp = tmp_path_factory.mktemp("classify")
    src = tmp / "in.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), src)
    current, summary, _ = run_demo_cli(src, tmp / "out", ds=DS, run_id="classify", sets=SETS)
    return pq.read_table(Location(current["dataset"]).path()), summary, demo_model_dir


def _transformers_scores(model_dir, reviews: list[str]) -> list[list[float]]:
    """The same probabilities from transformers: softmax over the label tokens' logits at the last position
    of each chat-formatted prompt (float32, as the CPU engine runs it)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    label_ids = [tok.convert_tokens_to_ids(label) for label in LABELS]
    out = []
    with torch.no_grad():
        for review in reviews:
            text = tok.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": review}],
                                           tokenize=False, add_generation_prompt=True)
            ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
            logits = model(ids).logits[0, -1, label_ids]
            out.append(torch.softmax(logits, -1).tolist())
    return out


def test_every_row_has_a_class_and_one_typed_score_column_per_class(run):
    table, summary, _ = run
    assert table.num_rows == len(ROWS) and summary["rows_published"] == len(ROWS)
    assert table.schema.field("output_label").type == pa.string()
    assert table.schema.field("label").type == pa.string()  # the input's gold label, kept
    for c in LABELS:
        assert table.schema.field(f"score_{c}").type == pa.float64()
    for r in table.to_pylist():
        scores = [r[f"score_{c}"] for c in LABELS]
        assert abs(sum(scores) - 1) < 1e-4 and all(0 <= s <= 1 for s in scores), r
        assert r["output_label"] == LABELS[scores.index(max(scores))], r
        assert r["output"] is None and r["error"] is None and r["prompt_tokens"] > 0 and r["completion_tokens"] == 0


def test_scores_are_the_models_own_next_token_probabilities_over_the_labels(run):
    table, _, model_dir = run
    rows = table.to_pylist()
    expected = _transformers_scores(model_dir, [r["review"] for r in rows])
    diffs = []
    for r, want in zip(rows, expected):
        got = [r[f"score_{c}"] for c in LABELS]
        diffs.append(max(abs(g - w) for g, w in zip(got, want)))
        # Measured here: one row at a time, vLLM's classify matches transformers to 1e-5; batched with the
        # shard's other rows (CPU prefill of several sequences at once) a row moves by up to ~2 % of
        # probability. A wrong label token, order or position would be tens of percent off.
        assert diffs[-1] < 0.05, (r["id"], got, want)
        if max(want) - sorted(want)[-2] > 0.04:  # a clear winner: the same class
            assert r["output_label"] == LABELS[want.index(max(want))], (r["id"], got, want)
    assert sum(diffs) / len(diffs) < 0.02, diffs
    print("max/mean abs diff", max(diffs), sum(diffs) / len(diffs))


def test_filter_and_evaluate_skip_a_classify_run(run):
    _, summary, _ = run
    assert summary["manifests"]["filter"]["skipped"] == "task classify"
    assert summary["manifests"]["evaluate"]["skipped"] == "task classify"
    usage = summary["usage"]
    assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] == 0


def test_labels_must_be_single_tokens_and_a_causal_lm_needs_labels(demo_model_dir):
    assert classify_labels(str(demo_model_dir), LABELS) == LABELS
    with pytest.raises(EngineCannotRun, match=r"one token of the model's vocabulary.*'正面' is \d+ tokens"):
        classify_labels(str(demo_model_dir), ["正面", "负面"])
    with pytest.raises(EngineCannotRun, match=r"needs a model with a classification head.*LlamaForCausalLM"):
        classify_labels(str(demo_model_dir), None)
