"""``engine.precision`` and ``engine.precision_gate``: serve a lower precision (FP8 on a GPU that has it) only where a
calibration sample of the day's own rows, run in both precisions, agrees within the user's threshold.

The gate itself runs at engine start (``engines/precision_gate.py``); this module is its configuration and the
table of engine keys a candidate may set.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# The engine keys a candidate precision may set, and why each is one: weights, KV cache, compute dtype.
CANDIDATE_KEYS = {
    "quantization": "the weights' format (fp8: vLLM's online FP8, per-tensor scales, on a GPU of compute "
                    "capability 8.9 or newer)",
    "kv_cache_dtype": "the KV cache's dtype (fp8: twice the tokens in the same memory)",
    "dtype": "the compute dtype (e.g. bfloat16 against a float32 checkpoint)",
}
# Candidate values that need an FP8-capable GPU (compute capability 8.9: Ada, Hopper and newer)
FP8_VALUES = frozenset({"fp8", "fp8_e4m3", "fp8_e5m2"})

Precision = Literal["model", "auto"]


class PrecisionGateConfig(BaseModel):
    """How ``engine.precision: auto`` decides. The sample is the shard's first rows (text rows; rows with images
    are not sampled), generated greedily in the model's precision and in the candidate's; the candidate serves
    the shard where their outputs agree on at least ``min_agreement`` of the tokens (see ``agreement``). The
    decision is stored beside the result cache, keyed by model, engine settings, candidate, gate and GPU, so
    later shards and days reuse it without calibrating again."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    candidate: dict[str, Any] = Field(
        default_factory=lambda: {"quantization": "fp8"},
        description="Engine keys of the lower precision tried against the model's own: quantization (fp8), "
        "kv_cache_dtype (fp8), dtype. An FP8 candidate is tried only on a GPU of compute capability 8.9 or newer; "
        "elsewhere the model's precision serves, and the manifest says why")
    sample_rows: int = Field(64, gt=0, le=4096, description="Rows of the shard in the calibration sample")
    max_tokens: int = Field(64, gt=0, le=4096, description="Tokens generated per sample row, greedily")
    min_agreement: float = Field(
        0.9, ge=0, le=1, description="The least agreement that lets the candidate serve: the mean, over the "
        "sample, of the share of the model precision's tokens the candidate reproduces before its first "
        "different token (1.0: identical greedy outputs)")

    @field_validator("candidate")
    @classmethod
    def _known_keys(cls, v: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(v) - set(CANDIDATE_KEYS))
        if unknown:
            raise ValueError(f"{', '.join(unknown)}: a candidate sets only {', '.join(CANDIDATE_KEYS)}")
        if not v:
            raise ValueError("an empty candidate is the model's own precision: name what it changes, e.g. "
                             "{quantization: fp8}")
        return v

    def needs_fp8(self) -> bool:
        return any(str(value).lower() in FP8_VALUES for value in self.candidate.values())
