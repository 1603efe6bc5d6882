"""Which precision serves a shard when engine.precision is auto. The candidate precision (FP8 weights by default)
serves only where a calibration sample of the shard's own rows, generated greedily in both precisions, agrees
within ``engine.precision_gate.min_agreement``.

    start model precision → sample → close → start candidate → sample → agreement
        ≥ threshold: the candidate's engine serves the shard (no further start)
        <  threshold: it is closed and the model's precision starts again

The decision is stored as JSON beside the result cache (``<cache root>/precision/<key>.json``), keyed by the
model, the engine settings, the gate and the GPU, so a later shard or day starts the chosen precision at once.
Where the candidate needs FP8 and the GPU has none (a CPU, a GPU below compute capability 8.9), nothing is
calibrated: the model's precision serves and the record says why. Every outcome is in the engine's settings
(``precision``), so the manifest and the report show it.
"""
from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from batch_llm.engines.base import Engine, EngineInfo, GenRequest
from batch_llm.io.storage import exists, read_json, write_json
from batch_llm.rows.params import RowParams

if TYPE_CHECKING:
    from batch_llm.config import PipelineConfig
    from batch_llm.io.storage import Location

Start = Callable[["PipelineConfig"], tuple[Engine, EngineInfo]]


@dataclass
class PrecisionInputs:
    """What the gate needs from the shard: its calibration sample (built only when a calibration runs), where
    decisions are kept (None: not kept, e.g. the result cache off), and the model's identity."""

    sample: Callable[[], list[GenRequest]]
    store: "Location | None"
    model_key: str


def sample_params(max_tokens: int) -> RowParams:
    """A sample row's parameters: greedy, one sample, the chosen tokens returned (logprobs 0), ``max_tokens``."""
    return RowParams(max_tokens=max_tokens, temperature=0.0, n=1, logprobs=0, seed=0)


def agreement(reference: Sequence[str], candidate: Sequence[str]) -> float:
    """The share of the longer output the two share before their first different token: 1.0 for identical
    greedy outputs, 0.0 where the first token differs."""
    longest = max(len(reference), len(candidate))
    if longest == 0:
        return 1.0
    same = 0
    for a, b in zip(reference, candidate):
        if a != b:
            break
        same += 1
    return same / longest


def decision_key(model_key: str, cfg: "PipelineConfig", device: str, engine_version: str) -> str:
    """What a decision depends on: the model, every engine setting (the gate's included), the sampling that
    shapes a greedy output (stop strings, penalties), the GPU and the engine's version."""
    engine = cfg.engine.model_dump(mode="json", exclude={"progress_every_seconds", "commit_every_rows",
                                                         "commit_every_seconds", "max_error_rate"})
    sampling = cfg.sampling.model_dump(mode="json", include={"stop", "stop_token_ids", "repetition_penalty",
                                                             "ignore_eos"})
    basis = json.dumps({"model": model_key, "engine": engine, "sampling": sampling, "device": device,
                        "engine_version": engine_version}, sort_keys=True, default=str)
    return hashlib.sha256(basis.encode()).hexdigest()[:24]


def _tokens(engine: Engine, sample: list[GenRequest]) -> dict[str, list[str]]:
    """Each sample request's generated tokens (failed requests left out)."""
    out: dict[str, list[str]] = {}
    for res in engine.generate(sample):
        if res.error is None and res.samples and res.samples[0].logprobs is not None:
            out[res.key] = [t.token for t in res.samples[0].logprobs]
    return out


def _fp8_refusal(device_capability: tuple[int, int] | None, device: str) -> str | None:
    if device_capability is None:
        return f"the candidate needs FP8 and this engine runs on {device}, not a CUDA GPU"
    if device_capability < (8, 9):
        major, minor = device_capability
        return (f"the candidate needs FP8, which needs a GPU of compute capability 8.9 or newer; {device} is "
                f"{major}.{minor}")
    return None


def _platform() -> tuple[str, tuple[int, int] | None, str]:
    """The device's name, its CUDA compute capability (None: not a CUDA GPU) and vLLM's version, from vLLM's
    platform (NVML: asking torch here would initialize CUDA in this process before the engine core forks)."""
    import vllm
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return "cpu" if current_platform.is_cpu() else str(current_platform.device_type), None, vllm.__version__
    cap = current_platform.get_device_capability()
    name = current_platform.get_device_name()
    return name, (cap.major, cap.minor) if cap is not None else None, vllm.__version__


def _read(store: "Location | None", key: str) -> dict | None:
    if store is None:
        return None
    path = store.child(f"{key}.json").path()
    try:
        return read_json(path) if exists(path) else None
    except (OSError, ValueError):
        return None  # an unreadable record calibrates again


def _write(store: "Location | None", key: str, record: dict) -> None:
    if store is not None:  # atomic: a shard starting beside this one reads the whole record or none
        write_json(store.child(f"{key}.json").path(), record)


def with_candidate(cfg: "PipelineConfig") -> "PipelineConfig":
    engine = cfg.engine.model_copy(update=dict(cfg.engine.precision_gate.candidate))
    return cfg.model_copy(update={"engine": engine})


def gated_start(cfg: "PipelineConfig", start: Start, inputs: PrecisionInputs,
                say: Callable[[str], None]) -> tuple[Engine, EngineInfo]:
    """The engine ``engine.precision: auto`` chooses, started; ``start`` starts one for a config (memory back-off
    and probe included). The record lands in ``info.settings["precision"]``."""
    gate = cfg.engine.precision_gate
    device, capability, version = _platform()
    record: dict[str, Any] = {"candidate": dict(gate.candidate), "min_agreement": gate.min_agreement,
                              "device": device}
    refusal = _fp8_refusal(capability, device) if gate.needs_fp8() else None
    if refusal is not None:
        say(f"precision: the model's ({refusal})")
        return _started(start(cfg), {**record, "decision": "model", "reason": refusal})
    key = decision_key(inputs.model_key, cfg, device, version)
    known = _read(inputs.store, key)
    if known is not None and known.get("decision") in ("model", "candidate"):
        say(f"precision: {known['decision']} (decided before: agreement {known.get('agreement')})")
        chosen = with_candidate(cfg) if known["decision"] == "candidate" else cfg
        return _started(start(chosen), {**known, "from_cache": True})
    sample = inputs.sample()
    if not sample:
        why = "no text rows to calibrate on in this shard"
        say(f"precision: the model's ({why})")
        return _started(start(cfg), {**record, "decision": "model", "reason": why})
    t0 = time.perf_counter()
    engine, _ = start(cfg)
    try:
        reference = _tokens(engine, sample)
    finally:
        engine.close()
    engine, info = start(with_candidate(cfg))
    try:
        tried = _tokens(engine, sample)
    except BaseException:
        engine.close()
        raise
    both = sorted(set(reference) & set(tried))
    scores = [agreement(reference[k], tried[k]) for k in both]
    agree = round(sum(scores) / len(scores), 4) if scores else 0.0
    identical = sum(s == 1.0 for s in scores)
    first = sum(bool(reference[k]) and bool(tried[k]) and reference[k][0] == tried[k][0] for k in both)
    record.update(agreement=agree, sample_rows=len(both), identical_rows=identical,
                  first_token_agreement=round(first / len(both), 4) if both else 0.0,
                  max_tokens=gate.max_tokens, engine_version=version)
    if agree >= gate.min_agreement:
        record.update(decision="candidate", calibration_seconds=round(time.perf_counter() - t0, 2))
        info.start_seconds = record["calibration_seconds"]  # the calibration is part of this shard's start
        say(f"precision: the candidate {gate.candidate} serves: agreement {agree:.3f} >= {gate.min_agreement} "
            f"over {len(both)} rows ({identical} identical)")
        _write(inputs.store, key, record)
        return _started((engine, info), record)
    engine.close()
    record.update(decision="model", reason=f"agreement {agree:.3f} < {gate.min_agreement}")
    say(f"precision: the model's: the candidate {gate.candidate} agrees {agree:.3f} < {gate.min_agreement} over "
        f"{len(both)} rows ({identical} identical)")
    started = start(cfg)
    record["calibration_seconds"] = round(time.perf_counter() - t0, 2)
    started[1].start_seconds = record["calibration_seconds"]
    _write(inputs.store, key, record)
    return _started(started, record)


def _started(started: tuple[Engine, EngineInfo], record: dict) -> tuple[Engine, EngineInfo]:
    engine, info = started
    info.settings["precision"] = record
    return engine, info
