"""What one row's grammar costs per token, outside vLLM: xgrammar's and llguidance's mask fill and token accept.

vLLM's engine core does both for every guided row of every step (the accept serially in the scheduler's output
processing, the fill in its bitmask pool), so these per-token figures times the rows in a batch bound what a
guided step adds on the CPU. Each case is a tokenizer and the model's vocabulary size (the mask's length): the
demo tokenizer (49,152 tokens) under the 7B shape's 152,064 rows (what the H200 guided benchmarks ran), the same
tokenizer with the vocabulary cut to its size, and a Qwen2.5 tokenizer (151,665 tokens, ``bench qwen-tokenizer``)
under 152,064 rows, as a real 7B model has. One review-extraction answer is walked token by token, REPEATS times;
means and medians in microseconds; each case with the
schema whole and without its string length bounds (``sampling.guided_length_bounds: check``).

    python -m bench grammar-cost --qwen-tokenizer .gpu-stage/qwentok --out docs/bench-results/cpu-grammar-cost-2026-12-04.jsonl
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from bench.runners import ROOT, emit

SCHEMA = ROOT / "dags" / "pipelines" / "schemas" / "review_opinion.json"
ANSWER = {"aspect": "电池", "sentiment": "正面", "evidence": "续航很长，充电也快"}


def _us(xs: list[float]) -> dict:
    # the mean counts the few costly positions (a string's first token, an enum's) that the median hides
    return {"mean_us": round(statistics.fmean(xs) * 1e6, 2), "median_us": round(statistics.median(xs) * 1e6, 2),
            "max_us": round(max(xs) * 1e6, 1)}


def xgrammar_cost(tok, vocab: int, schema: dict, repeats: int) -> dict:
    import xgrammar as xgr

    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab), max_threads=1)
    t0 = time.perf_counter()
    grammar = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
    compile_s = time.perf_counter() - t0
    ids = tok.encode(json.dumps(ANSWER, ensure_ascii=False), add_special_tokens=False)  # xgrammar's ", " / ": "
    fills, accepts = [], []
    for _ in range(repeats):
        matcher, mask = xgr.GrammarMatcher(grammar), xgr.allocate_token_bitmask(1, vocab)
        for t in ids:
            a = time.perf_counter()
            matcher.fill_next_token_bitmask(mask)
            b = time.perf_counter()
            if not matcher.accept_token(t):
                raise SystemExit(f"xgrammar refused token {t} ({tok.decode([t])!r})")
            fills.append(b - a)
            accepts.append(time.perf_counter() - b)
    return {"compile_ms": round(compile_s * 1e3, 1), "tokens": len(ids), "fill": _us(fills), "accept": _us(accepts)}


def llguidance_cost(tok, vocab: int, schema: dict, repeats: int) -> dict:
    import llguidance
    import llguidance.hf
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    lt = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    ids = tok.encode(json.dumps(ANSWER, ensure_ascii=False, separators=(",", ":")), add_special_tokens=False)
    fills, accepts = [], []
    for _ in range(repeats):
        matcher, mask = llguidance.LLMatcher(lt, grammar), allocate_token_bitmask(1, vocab)
        for t in ids:
            a = time.perf_counter()
            fill_next_token_bitmask(matcher, mask, 0)
            b = time.perf_counter()
            if not matcher.consume_token(t):
                raise SystemExit(f"llguidance refused token {t}: {matcher.get_error()[:200]}")
            fills.append(b - a)
            accepts.append(time.perf_counter() - b)
    return {"tokens": len(ids), "fill": _us(fills), "accept": _us(accepts)}


def main(argv: list[str] | None = None) -> None:
    from batch_llm.demo_model import build_demo_model
    from batch_llm.output_schema import without_string_length_bounds
    from transformers import AutoTokenizer

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--qwen-tokenizer", type=Path, help="a folder from `bench qwen-tokenizer` (else that case is left out)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "grammar_cost.jsonl"))
    a = p.parse_args(argv)
    schema = json.loads(SCHEMA.read_text(encoding="utf-8"))
    demo = build_demo_model()
    cases = [("demo tokenizer, 7B vocabulary rows", demo, 152_064), ("demo tokenizer, vocabulary cut to it", demo, 49_152)]
    if a.qwen_tokenizer:
        cases.append(("Qwen2.5 tokenizer, 7B vocabulary rows", a.qwen_tokenizer, 152_064))
    schemas = {"full": schema, "without string length bounds": without_string_length_bounds(schema)}
    for name, path, vocab in cases:
        tok = AutoTokenizer.from_pretrained(path)
        for variant, grammar in schemas.items():  # the second: sampling.guided_length_bounds: check
            rec = {"case": name, "schema": variant, "tokenizer_tokens": len(tok), "vocab_rows": vocab,
                   "repeats": a.repeats, "xgrammar": xgrammar_cost(tok, vocab, grammar, a.repeats),
                   "llguidance": llguidance_cost(tok, vocab, grammar, a.repeats)}
            emit(a.out, "grammar_cost", rec, ensure_ascii=False)


if __name__ == "__main__":
    main()
