"""Fits the calibration constants of ``batch_llm/sizing/recommend.py`` to this project's measurements and prints them
with the model's error at every measured point (fitted and held out). No GPU needed::

    .venv/bin/python -m bench recommend-calibration

Each point: (what, model config, GPU, Job, measured output tok/s of ``LLM.generate``, source). The constants in
recommend.py are this script's output, rounded; ``tests/test_recommend.py`` checks that they still reproduce it.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
from collections.abc import Callable

from batch_llm.sizing import recommend as R

from bench.runners import ROOT

Q7 = R.load_model_shape(ROOT / "tests" / "data" / "qwen2.5-7b-config.json")
SMOL = R.ModelShape(hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                    intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True, name="SmolLM2-135M")
H200, CPU = R.DEVICES["H200"], R.DEVICES["CPU"]

# The 12 LLM.generate runs of 1000 prompts x 256 -> 256 (bf16, one H200, five machines).
FIXED_RUNS = [13702, 15974,                     # a plain LLM.generate script (two runs)
              17337.5, 17036.7, 17126.4,        # h200-fixed-2026-12-01.jsonl (raw)
              14637.6, 16171.7, 16594.1,        # h200-fixed-final-only-2026-12-01.jsonl (raw)
              18644.3, 19196.7,                 # h200-fp8-2026-12-01.jsonl (bf16)
              13953, 14497]                     # h200-fixed-2026-11-30.jsonl, h200-fixed-raw-hf-2026-11-30.jsonl (old clock)
FIXED = statistics.median(FIXED_RUNS)
FIXED_JOB = R.Job(rows=1000, prompt_tokens=256, output_tokens=256)


def rate(shape, device, job):
    return R.output_tokens_per_second(shape, device, 1, job)


def bisect(f, lo, hi, n=80):
    """x in [lo, hi] where f(x) crosses 0 (f increasing)."""
    for _ in range(n):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < 0 else (lo, mid)
    return (lo + hi) / 2


def _probe(constant: str, value: float, residual: Callable[[], float]) -> float:
    """The residual with the model's ``constant`` set to ``value``: what the bisection looks for the zero of."""
    setattr(R, constant, value)
    return residual()


def fit() -> dict:
    # ETA_MEMORY: batch 1 (h200-ngram-spec-2026-12-01.jsonl, plain: 210.9 / 210.5 / 211.1 tok/s)
    b1 = R.Job(rows=1, prompt_tokens=256, output_tokens=256)
    R.ETA_MEMORY = bisect(lambda e: _probe("ETA_MEMORY", e, lambda: rate(Q7, H200, b1) - 210.9), 0.1, 1.0)
    # ETA_COMPUTE: the fixed workload's median
    R.ETA_COMPUTE = bisect(lambda e: _probe("ETA_COMPUTE", e, lambda: rate(Q7, H200, FIXED_JOB) - FIXED), 0.1, 1.0)
    # FP8_COMPUTE: FP8 weights 1.217x bf16 at the fixed workload (h200-fp8-2026-12-01.jsonl)
    bf16 = rate(Q7, H200, FIXED_JOB)
    fp8 = dataclasses.replace(FIXED_JOB, scheme="fp8")
    R.FP8_COMPUTE = bisect(lambda k: _probe("FP8_COMPUTE", k, lambda: rate(Q7, H200, fp8) / bf16 - 1.217), 0.5, 3.0)
    # CPU: two points, two constants (cpu-make-bench*.txt raw 81.4 / 77.4 s; guided_engine_cpu.jsonl plain 39.05 s)
    cpu_fixed = R.Job(rows=256, prompt_tokens=128, output_tokens=64, max_model_len=1024)
    cpu_small = R.Job(rows=8, prompt_tokens=100, output_tokens=64, max_model_len=1024, cached_prompt_share=1.0)
    t_fixed, t_small = statistics.median([81.41, 77.4]), 39.05

    def cpu_err(flops):
        R.CPU_FLOPS = flops
        # the step constant that fits the small run exactly, then the big run's error
        R.CPU_STEP_S = 0.0
        s0, _ = R.generation_seconds(SMOL, CPU, 1, cpu_small, 8)
        R.CPU_STEP_S = (t_small - s0) / 64
        s, _ = R.generation_seconds(SMOL, CPU, 1, cpu_fixed, 256)
        return t_fixed - s            # increasing in flops
    bisect(cpu_err, 1e10, 1e13)
    return dict(ETA_MEMORY=R.ETA_MEMORY, ETA_COMPUTE=R.ETA_COMPUTE, FP8_COMPUTE=R.FP8_COMPUTE,
                CPU_STEP_S=R.CPU_STEP_S, CPU_FLOPS=R.CPU_FLOPS)


CHECKS = [  # (what, shape, device, job, measured output tok/s, source) -- not used by the fit
    ("H200 batch 32, 256 -> 256", Q7, H200, R.Job(rows=32, prompt_tokens=256, output_tokens=256), 5577.5,
     "h200-ngram-spec-2026-12-01.jsonl plain"),
    ("H200 batch 256, 256 -> 256", Q7, H200, R.Job(rows=256, prompt_tokens=256, output_tokens=256), 17649,
     "h200-ngram-spec-2026-12-01.jsonl plain (median)"),
    ("H200 512 rows, ~100 cached prompt tokens -> 256", Q7, H200,
     R.Job(rows=512, prompt_tokens=100, output_tokens=256, cached_prompt_share=1.0), 33634,
     "h200-guided-2026-12-01.jsonl plain (median, first machine; the prompts repeat the warm-up's: prefix-cache hits)"),
    ("H200 FP8 KV cache, 1000 x 256 -> 256", Q7, H200, dataclasses.replace(FIXED_JOB, kv_dtype="fp8"),
     statistics.median([16811.2, 15421.1]), "h200-fp8-2026-12-01.jsonl (fitted as a ratio: 0.852)"),
]


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    consts = fit()
    for k, v in consts.items():
        print(f"{k} = {v:.4g}")
    print(f"fixed 1000 x 256 -> 256: median of {len(FIXED_RUNS)} runs {FIXED:,.0f} tok/s "
          f"(range {min(FIXED_RUNS):,.0f}-{max(FIXED_RUNS):,.0f}); model {rate(Q7, H200, FIXED_JOB):,.0f}")
    for what, shape, dev, job, measured, src in CHECKS:
        pred = rate(shape, dev, job)
        print(f"{what}: model {pred:,.0f}, measured {measured:,.0f} ({pred / measured - 1:+.1%}; {src})")
    plan = R.memory_plan(Q7, H200, 1, FIXED_JOB)
    print(f"Qwen2.5-7B: {Q7.params / 1e9:.3f}B params, bf16 {Q7.weight_bytes('bf16') / R.GIB:.2f} GiB (14.29 loaded), "
          f"fp8 {Q7.weight_bytes('fp8') / R.GIB:.2f} GiB (8.17), KV {plan.kv_tokens:,} tokens (2,043,840), "
          f"activation {plan.activation_gib:.2f} GiB (2.15)")

