"""Three engine features on a GPU, each measured inside one vLLM process per engine configuration.

    python -m bench gpu-features guided --model DIR --tokenizer TOKDIR [--rows 512] [--repeats 3]
    python -m bench gpu-features spec --model DIR --method plain|ngram|ngram_gpu [--repeats 3]
    python -m bench gpu-features fp8 --model DIR --variant bf16|fp8|fp8kv [--repeats 2]

``bench/run_gpu.sh guided|spec|fp8`` runs them (one process per engine, each under its own timeout). The model is
a random-weight (``load_format="dummy"``) Qwen2.5-7B-shaped config: outputs are meaningless, the work is real.
Every figure is printed as a ``RESULT {json}`` line and appended to ``--out`` (JSONL).

guided  One engine, the 7B config with a small real tokenizer (``--tokenizer``: the demo model's, 49,152 tokens;
        the model's 152,064-row vocab is larger, which vLLM and xgrammar accept: the extra ids are never allowed
        by the grammar). ``--rows`` review-extraction chats (the sample reviews, each row numbered so that no two
        prompts are equal), tokenized once, fed as token ids to both modes.
        guided: ``StructuredOutputsParams(json=review_opinion.json)`` (xgrammar), max_tokens ``--max-tokens``,
        greedy; a row ends where its JSON object ends (EOS) or at max_tokens. ``--compact-json``: no free whitespace
        in the grammar (``disable_any_whitespace``), so rows end where the object does.
        plain:  no grammar, greedy, ``ignore_eos``, each row's max_tokens set to the length its guided output had
        in the warm-up run, so both modes generate the same number of tokens per row (the same work; only the
        grammar mask differs). A warm-up of each mode first, then ``--repeats`` of each, alternating
        (plain, guided | guided, plain | ...). Clock: ``llm.generate`` call to outputs in memory (prefill of the
        short prompts included), tokens = generated tokens (``len(token_ids)``) summed over rows.
spec    One engine per ``--method`` (plain: no speculation; ngram: vLLM's CPU n-gram proposer, which needs numba;
        ngram_gpu: its GPU one), ``num_speculative_tokens`` 4, prompt_lookup 2..4. Prompts of 256 tokens that are a
        random 16-token pattern repeated 16 times (so a lookup can match); 256 output tokens, greedy, ignore_eos;
        batch sizes 1, 32, 256 (the whole batch in one ``llm.generate``), fresh prompts for every run (no prefix-cache
        hit between runs), the same prompts for every method. Acceptance from vLLM's own counters
        (``llm.get_metrics()``: drafts, draft tokens, accepted tokens, per position), as deltas around each run.
fp8     One engine per ``--variant``: bf16, ``quantization="fp8"`` (online FP8 weights), ``kv_cache_dtype="fp8"``.
        Engine start (process start → vLLM imported, then ``LLM(...)``), the KV cache it got
        (``num_gpu_blocks × block_size`` tokens), then
        ``--repeats`` runs of the ``fixed`` dataset of ``bench/inference.py`` (1000 prompts × 256 random tokens → 256,
        greedy, ignore_eos; a new seed per run so that no prompt is cached from the run before).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback
from typing import Any

from bench.inference import make_dataset
from bench.runners import ROOT, alternating, model_vocab, spread, start_vllm
from bench.runners import emit as emit_to

SYSTEM = "从商品评论中提取一个方面、情感和原文证据，只输出 JSON。"


def emit(a, rec: dict) -> None:
    emit_to(a.out, a.cmd, rec, ensure_ascii=False)


def generate(llm, prompts, params) -> tuple[float, list]:
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t, outs


# ------------------------------------------------------------------------------------------------- guided
def guided_prompts(a) -> list:
    from transformers import AutoTokenizer
    from vllm.inputs import TokensPrompt

    tok = AutoTokenizer.from_pretrained(a.tokenizer)
    reviews = [json.loads(x)["prompt"] for x in (ROOT / "include" / "sample_data" / "reviews_zh.jsonl").open()]
    prompts = []
    for i in range(a.rows):
        chat = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"第{i + 1}条评论：{reviews[i % len(reviews)]}"}]
        enc = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        ids = enc if isinstance(enc, list) else list(enc["input_ids"])
        prompts.append(TokensPrompt(prompt_token_ids=ids))
    return prompts


def guided_check(outs, schema) -> dict:
    import jsonschema

    valid = ended = 0
    for o in outs:
        c = o.outputs[0]
        ended += c.finish_reason == "stop"
        try:
            jsonschema.validate(json.loads(c.text), schema)
            valid += 1
        except Exception:  # noqa: BLE001 - counted, not raised
            pass
    return {"rows_ended_by_grammar": ended, "rows_valid_json": valid, "example": outs[0].outputs[0].text[:200]}


# Where a guided decode step's CPU time goes: the grammar work of vLLM's engine core, timed in place. Each entry:
# (module, class or None, function, the name it is reported under).
GRAMMAR_TIMERS = (
    ("vllm.v1.structured_output", "StructuredOutputManager", "grammar_bitmask", "bitmask"),  # every row's mask
    ("vllm.v1.structured_output", "StructuredOutputManager", "_fill_bitmasks", "fill_in_threads"),  # summed over threads
    ("vllm.v1.core.sched.scheduler", "Scheduler", "update_from_output", "update_from_output"),  # accepts tokens
    ("vllm.v1.core.sched.scheduler", "Scheduler", "schedule", "schedule"),
    ("vllm.v1.worker.gpu_model_runner", None, "apply_grammar_bitmask", "apply_bitmask"),  # reorder, copy, mask
)


class GrammarTimers:
    """Seconds and calls inside the engine core's grammar work (``GRAMMAR_TIMERS``), for an engine core in this
    process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): wrapped before the engine is built, read as deltas around
    each ``generate``. ``fill_in_threads`` is thread time summed over vLLM's fill pool: against ``bitmask``'s wall
    time it says whether the pool's threads ran in parallel (the GIL released) or in turn."""

    def __init__(self) -> None:
        import importlib
        import threading

        self.totals = {name: [0.0, 0] for *_, name in GRAMMAR_TIMERS}
        self._lock = threading.Lock()
        for module, cls, fn, name in GRAMMAR_TIMERS:
            owner = importlib.import_module(module)
            owner = getattr(owner, cls) if cls else owner
            setattr(owner, fn, self._timed(getattr(owner, fn), name))

    def _timed(self, f, name: str):
        import functools

        @functools.wraps(f)
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return f(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                with self._lock:
                    self.totals[name][0] += dt
                    self.totals[name][1] += 1
        return timed

    def snapshot(self) -> dict:
        with self._lock:
            return {k: tuple(v) for k, v in self.totals.items()}

    @staticmethod
    def delta(before: dict, after: dict) -> dict:
        return {f"{k}_s": round(after[k][0] - before[k][0], 3) for k in after} | \
               {f"{k}_calls": after[k][1] - before[k][1] for k in after}


def cmd_guided(a) -> None:
    import os

    if a.timers:  # the engine core in this process, so that its grammar work can be timed in place
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    schema = json.loads((ROOT / "dags" / "pipelines" / "schemas" / "review_opinion.json").read_text())
    grammar = schema  # what vLLM decodes under; outputs are checked against the whole schema either way
    if a.without_length_bounds:  # sampling.guided_length_bounds: check
        from batch_llm.output_schema import without_string_length_bounds

        grammar = without_string_length_bounds(schema)
    prompts = guided_prompts(a)
    so = {"backend": a.backend} if a.backend != "auto" else {}
    if a.compact_json:  # no free whitespace between JSON tokens (xgrammar's and guidance's option)
        so = {"backend": "xgrammar" if a.backend == "auto" else a.backend, "disable_any_whitespace": True}
    extra: dict[str, Any] = {"structured_outputs_config": so} if so else {}
    if a.match_vocab:  # the model's vocabulary cut to the tokenizer's (as a real model's is): a mask of that size
        from transformers import AutoTokenizer

        extra["hf_overrides"] = {"vocab_size": len(AutoTokenizer.from_pretrained(a.tokenizer))}
    if a.no_async_scheduling:  # both modes step by step: what guided decoding costs once plain loses the overlap too
        extra["async_scheduling"] = False
    timers = GrammarTimers() if a.timers else None
    llm, info = start_vllm(a.model, tokenizer=a.tokenizer, **extra)
    emit(a, {"phase": "engine", "rows": len(prompts), "compact_json": a.compact_json, "backend": a.backend, **info,
             "without_length_bounds": a.without_length_bounds, "no_async_scheduling": a.no_async_scheduling,
             "prompt_tokens": sum(len(p["prompt_token_ids"]) for p in prompts), "timers": a.timers,
             "vocab_size": llm.llm_engine.vllm_config.model_config.get_vocab_size()})
    guided = SamplingParams(max_tokens=a.max_tokens, temperature=0.0,
                            structured_outputs=StructuredOutputsParams(json=grammar))
    seconds, outs = generate(llm, prompts, guided)  # warm-up; its lengths fix the plain mode's work
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    emit(a, {"phase": "warmup", "mode": "guided", "seconds": round(seconds, 2), "tokens": sum(lengths),
             "length_min": min(lengths), "length_median": statistics.median(lengths), "length_max": max(lengths),
             **guided_check(outs, schema)})
    plain = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    seconds, outs = generate(llm, prompts, plain)
    emit(a, {"phase": "warmup", "mode": "plain", "seconds": round(seconds, 2),
             "tokens": sum(len(o.outputs[0].token_ids) for o in outs)})
    rates: dict[str, list[float]] = {"plain": [], "guided": []}
    for rep, mode in alternating(("plain", "guided"), a.repeats):
        before = timers.snapshot() if timers else {}
        seconds, outs = generate(llm, prompts, guided if mode == "guided" else plain)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        rates[mode].append(tokens / seconds)
        rec = {"phase": "timed", "mode": mode, "compact_json": a.compact_json, "backend": a.backend, "repeat": rep,
               "rows": len(prompts),
               "seconds": round(seconds, 3), "tokens": tokens, "tok_s": round(tokens / seconds, 1),
               **(GrammarTimers.delta(before, timers.snapshot()) if timers else {})}
        if mode == "guided":
            rec.update({k: v for k, v in guided_check(outs, schema).items() if k != "example"})
        emit(a, rec)
    ratios = [g / p for g, p in zip(rates["guided"], rates["plain"])]
    emit(a, {"phase": "summary", "compact_json": a.compact_json, "backend": a.backend,
             "plain_tok_s": spread(rates["plain"]),
             "guided_tok_s": spread(rates["guided"]),
             "guided_over_plain_per_repeat": [round(r, 3) for r in ratios], "ratio": spread(ratios)})
    same = [SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True)]
    seconds, outs = generate(llm, prompts, same * len(prompts))  # context: plain at the full max_tokens, once
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    emit(a, {"phase": "context", "mode": f"plain_{a.max_tokens}", "seconds": round(seconds, 3), "tokens": tokens,
             "tok_s": round(tokens / seconds, 1)})


# --------------------------------------------------------------------------------------------------- spec
def repeated_pattern_prompts(n: int, seed: int, vocab: int, pattern: int = 16, length: int = 256) -> list:
    import numpy as np
    from vllm.inputs import TokensPrompt

    rng = np.random.default_rng(seed)
    return [TokensPrompt(prompt_token_ids=np.tile(rng.integers(100, vocab, pattern), length // pattern).tolist())
            for _ in range(n)]


def spec_counters(llm) -> dict:
    out: dict[str, Any] = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": []}
    names = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "accepted"}
    for m in llm.get_metrics():
        if m.name in names:
            out[names[m.name]] += m.value
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            vals = list(m.values)
            out["per_pos"] = [x + y for x, y in zip(out["per_pos"] or [0] * len(vals), vals)]
    return out


def cmd_spec(a) -> None:
    from vllm import SamplingParams

    spec = None if a.method == "plain" else {"method": a.method, "num_speculative_tokens": 4,
                                              "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    try:
        llm, info = start_vllm(a.model, skip_tokenizer_init=True, disable_log_stats=False, speculative_config=spec)
    except Exception as e:  # noqa: BLE001 - recorded: the measurement is the failure
        emit(a, {"phase": "engine", "method": a.method, "speculative_config": spec, "error": f"{type(e).__name__}: {e}",
                 "traceback_tail": traceback.format_exc()[-1500:]})
        raise
    emit(a, {"phase": "engine", "method": a.method, "speculative_config": spec, **info})
    vocab = 150000
    params = SamplingParams(max_tokens=a.out_len, temperature=0.0, ignore_eos=True, detokenize=False)
    generate(llm, repeated_pattern_prompts(8, 999, vocab), SamplingParams(max_tokens=32, temperature=0.0,
                                                                          ignore_eos=True, detokenize=False))
    for bs in (int(x) for x in a.batch_sizes.split(",")):
        for rep in range(a.repeats):
            prompts = repeated_pattern_prompts(bs, 1000 * bs + rep, vocab)
            before = spec_counters(llm) if spec else {}
            seconds, outs = generate(llm, prompts, params)
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            rec = {"phase": "timed", "method": a.method, "batch": bs, "repeat": rep, "seconds": round(seconds, 3),
                   "tokens": tokens, "tok_s": round(tokens / seconds, 1)}
            if spec:
                after = spec_counters(llm)
                d = {k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted")}
                pos = [x - y for x, y in zip(after["per_pos"], before["per_pos"] or [0] * len(after["per_pos"]))]
                rec.update(d, accepted_per_pos=pos,
                           acceptance_rate=round(d["accepted"] / d["draft_tokens"], 4) if d["draft_tokens"] else None,
                           mean_accepted_per_draft=round(d["accepted"] / d["drafts"], 3) if d["drafts"] else None)
            emit(a, rec)


# ---------------------------------------------------------------------------------------------------- fp8
def cmd_fp8(a) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    extra = {"bf16": {}, "fp8": {"quantization": "fp8"}, "fp8kv": {"kv_cache_dtype": "fp8"}}[a.variant]
    try:
        llm, info = start_vllm(a.model, skip_tokenizer_init=True, **extra)
    except Exception as e:  # noqa: BLE001 - recorded: the measurement is the failure
        emit(a, {"phase": "engine", "variant": a.variant, "error": f"{type(e).__name__}: {e}",
                 "traceback_tail": traceback.format_exc()[-1500:]})
        raise
    emit(a, {"phase": "engine", "variant": a.variant, **info})
    vocab = model_vocab(a.model)
    warm = make_dataset("fixed", 32, 256, 16, vocab - 1, 2048, seed=99)
    generate(llm, [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in warm],
             SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, detokenize=False))
    for rep in range(a.repeats):
        rows = make_dataset("fixed", a.n, 256, 256, vocab - 1, 2048, seed=rep)
        prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in rows]
        seconds, outs = generate(llm, prompts, SamplingParams(max_tokens=256, temperature=0.0, ignore_eos=True,
                                                              detokenize=False))
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        emit(a, {"phase": "timed", "variant": a.variant, "repeat": rep, "seed": rep, "rows": len(rows),
                 "seconds": round(seconds, 3), "output_tokens": tokens, "output_tok_s": round(tokens / seconds, 1),
                 "total_tok_s": round((tokens + 256 * len(rows)) / seconds, 1)})


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("guided", "spec", "fp8"):
        p = sub.add_parser(name)
        p.add_argument("--model", default="/root/work/qwen7b_cfg")
        p.add_argument("--out", default=str(ROOT / "docs" / "bench-results" / f"gpu-features-{name}.jsonl"))
        p.add_argument("--repeats", type=int, default=2 if name == "fp8" else 3)
    g = sub.choices["guided"]
    g.add_argument("--tokenizer", required=True)
    g.add_argument("--rows", type=int, default=512)
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--backend", choices=("auto", "xgrammar", "guidance", "outlines"), default="auto",
                   help="vLLM's structured-outputs backend (auto: vLLM's choice)")
    g.add_argument("--compact-json", action="store_true", help="xgrammar without free whitespace between JSON "
                   "tokens (structured_outputs_config.disable_any_whitespace): a random-weight model then cannot "
                   "loop in whitespace and each row ends where its object does")
    g.add_argument("--timers", action="store_true", help="the engine core in this process, its grammar work timed "
                   "in place (GrammarTimers): where a guided step's time goes")
    g.add_argument("--without-length-bounds", action="store_true", help="decode under the schema without its "
                   "string length bounds (sampling.guided_length_bounds: check); outputs checked against it whole")
    g.add_argument("--match-vocab", action="store_true", help="the model's vocabulary cut to the tokenizer's "
                   "(hf_overrides vocab_size), as a real model's matches its tokenizer")
    g.add_argument("--no-async-scheduling", action="store_true", help="vLLM's asynchronous scheduling off "
                   "(async_scheduling=False) for both modes: a guided step waits for the step before it (its masks "
                   "need that step's tokens), so this shows what is left of the cost once plain steps wait too")
    s = sub.choices["spec"]
    s.add_argument("--method", choices=("plain", "ngram", "ngram_gpu"), required=True)
    s.add_argument("--batch-sizes", default="1,32,256")
    s.add_argument("--out-len", type=int, default=256)
    f = sub.choices["fp8"]
    f.add_argument("--variant", choices=("bf16", "fp8", "fp8kv"), required=True)
    f.add_argument("--n", type=int, default=1000)
    a = ap.parse_args(argv)
    {"guided": cmd_guided, "spec": cmd_spec, "fp8": cmd_fp8}[a.cmd](a)

