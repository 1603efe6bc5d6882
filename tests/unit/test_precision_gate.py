"""engine.precision: auto — the config it takes, the agreement it measures and the engine it keeps. The engines
here are doubles that answer with fixed tokens per precision; tests/system/test_precision_gate_engine.py runs the gate on
the real CPU engine."""
from __future__ import annotations

import copy
import json

import pytest
import yaml
from batch_llm.config import ConfigError, parse_config
from batch_llm.engines import precision_gate as gate
from batch_llm.engines.base import Engine, EngineInfo, GenRequest, GenResult, Sample, TokenLogprob
from batch_llm.io.storage import Location
from helpers import ROOT

BASE = yaml.safe_load((ROOT / "dags" / "pipelines" / "demo.yaml").read_text())


def config(**engine):
    data = copy.deepcopy(BASE)
    data["engine"].update(engine)
    data["input"]["path"] = "in.jsonl"
    data["output"]["path"] = "out"
    return parse_config(data, "test.yaml")


# ------------------------------------------------------------------------------------------ config
def test_auto_defaults_to_fp8_weights():
    c = config(precision="auto")
    assert c.engine.precision_gate.candidate == {"quantization": "fp8"}
    assert c.engine.precision_gate.needs_fp8()
    assert not config(precision="auto", precision_gate={"candidate": {"dtype": "bfloat16"}}).engine.precision_gate.needs_fp8()


@pytest.mark.parametrize("engine, message", [
    ({"precision": "auto", "quantization": "fp8"}, "engine.quantization is set and engine.precision: auto"),
    ({"precision_gate": {"min_agreement": 0.5}}, "settings of engine.precision: auto; engine.precision is 'model'"),
    ({"precision": "auto", "precision_gate": {"candidate": {"load_format": "x"}}}, "a candidate sets only"),
    ({"precision": "auto", "precision_gate": {"candidate": {}}}, "an empty candidate"),
    ({"precision": "auto", "precision_gate": {"min_agreement": 1.5}}, "less than or equal to 1"),
    ({"precision": "auto", "kind": "transformers", "enforce_eager": False},
     r"engine.precision: the precision gate .* engine.kind is .transformers. \(vllm can\)"),
    ({"precision": "fast"}, "engine.precision"),
])
def test_refused_with_a_reason(engine, message):
    with pytest.raises(ConfigError, match=message):
        config(**engine)


# ------------------------------------------------------------------------------------------ agreement
@pytest.mark.parametrize("a, b, expected", [
    (["x", "y", "z"], ["x", "y", "z"], 1.0),
    (["x", "y", "z", "w"], ["x", "y", "q", "w"], 0.5),   # the tokens after the first difference do not count
    (["x", "y"], ["x", "y", "z", "w"], 0.5),            # a longer output is a difference too
    (["a"], ["b"], 0.0),
    ([], [], 1.0),
])
def test_agreement(a, b, expected):
    assert gate.agreement(a, b) == expected


# ------------------------------------------------------------------------------------------ the decision
class FixedTokens(Engine):
    """Answers every request with the tokens its precision gives: the reference's for the model's dtype, the
    candidate's own list where set."""

    kind = "vllm"
    log: list[str] = []

    def __init__(self, cfg, tokens):
        self.cfg, self.tokens, self.closed = cfg, tokens, False

    def start(self) -> EngineInfo:
        return EngineInfo(kind="vllm", version="test", settings={"dtype": self.cfg.dtype}, start_seconds=1.0)

    def generate(self, requests):
        for req in requests:
            assert req.params.temperature == 0.0 and req.params.logprobs == 0 and req.guided is False
            toks = tuple(TokenLogprob(t, 0.0) for t in self.tokens[req.key])
            yield GenResult(req.key, samples=(Sample("", "length", len(toks), logprobs=toks),))

    def close(self) -> None:
        self.closed = True
        FixedTokens.log.append(f"close {self.cfg.dtype}")


def run_gate(tmp_path, monkeypatch, *, candidate_tokens, min_agreement, store=True, device=("NVIDIA H100", (9, 0))):
    cfg = config(precision="auto", precision_gate={"candidate": {"dtype": "bfloat16"}, "sample_rows": 2,
                                                   "min_agreement": min_agreement})
    reference = {"s0": ["a", "b", "c", "d"], "s1": ["e", "f"]}
    started: list[FixedTokens] = []

    def start(c):
        e = FixedTokens(c.engine, candidate_tokens if c.engine.dtype == "bfloat16" else reference)
        started.append(e)
        FixedTokens.log.append(f"start {c.engine.dtype}")
        return e, e.start()

    monkeypatch.setattr(gate, "_platform", lambda: (device[0], device[1], "0.0-test"))
    sample = [GenRequest(key=k, prompt_token_ids=[1, 2], params=gate.sample_params(4), guided=False)
              for k in ("s0", "s1")]
    inputs = gate.PrecisionInputs(sample=lambda: sample, store=Location(str(tmp_path / "decisions")) if store else None,
                                  model_key="m")
    FixedTokens.log = []
    engine, info = gate.gated_start(cfg, start, inputs, say=lambda m: None)
    return engine, info, started


def test_candidate_that_agrees_serves_without_another_start(tmp_path, monkeypatch):
    engine, info, started = run_gate(tmp_path, monkeypatch, min_agreement=0.7,
                                     candidate_tokens={"s0": ["a", "b", "c", "x"], "s1": ["e", "f"]})
    rec = info.settings["precision"]
    assert (rec["decision"], rec["agreement"], rec["identical_rows"], rec["sample_rows"]) == ("candidate", 0.875, 1, 2)
    assert FixedTokens.log == ["start auto", "close auto", "start bfloat16"]
    assert engine is started[-1] and not engine.closed and engine.cfg.dtype == "bfloat16"
    assert info.start_seconds == rec["calibration_seconds"]  # the calibration is the start's cost
    saved = list((tmp_path / "decisions").glob("*.json"))
    assert len(saved) == 1 and json.loads(saved[0].read_text())["decision"] == "candidate"


def test_candidate_below_the_threshold_gives_way_to_the_model(tmp_path, monkeypatch):
    engine, info, started = run_gate(tmp_path, monkeypatch, min_agreement=0.9,
                                     candidate_tokens={"s0": ["a", "b", "c", "x"], "s1": ["e", "f"]})
    rec = info.settings["precision"]
    assert rec["decision"] == "model" and rec["reason"] == "agreement 0.875 < 0.9"
    assert FixedTokens.log == ["start auto", "close auto", "start bfloat16", "close bfloat16", "start auto"]
    assert engine.cfg.dtype == "auto" and not engine.closed


def test_a_stored_decision_is_reused_for_the_same_model_settings_and_gpu(tmp_path, monkeypatch):
    agreeing = {"s0": ["a", "b", "c", "d"], "s1": ["e", "f"]}
    run_gate(tmp_path, monkeypatch, min_agreement=0.9, candidate_tokens=agreeing)
    engine, info, started = run_gate(tmp_path, monkeypatch, min_agreement=0.9, candidate_tokens=agreeing)
    assert FixedTokens.log == ["start bfloat16"] and info.settings["precision"]["from_cache"] is True
    # another GPU calibrates again
    run_gate(tmp_path, monkeypatch, min_agreement=0.9, candidate_tokens=agreeing, device=("NVIDIA H200", (9, 0)))
    assert FixedTokens.log[:2] == ["start auto", "close auto"]
    assert len(list((tmp_path / "decisions").glob("*.json"))) == 2


def test_fp8_candidate_on_a_gpu_without_fp8_starts_the_model_without_calibrating(tmp_path, monkeypatch):
    cfg = config(precision="auto")  # candidate: FP8 weights
    monkeypatch.setattr(gate, "_platform", lambda: ("NVIDIA A100-SXM4-80GB", (8, 0), "0.0-test"))
    log = []

    def start(c):
        log.append(c.engine.quantization)
        e = FixedTokens(c.engine, {})
        return e, e.start()

    inputs = gate.PrecisionInputs(sample=lambda: pytest.fail("no sample without a calibration"), store=None,
                                  model_key="m")
    _, info = gate.gated_start(cfg, start, inputs, say=lambda m: None)
    assert log == [None]
    assert info.settings["precision"]["decision"] == "model"
    assert "compute capability 8.9 or newer; NVIDIA A100-SXM4-80GB is 8.0" in info.settings["precision"]["reason"]
    monkeypatch.setattr(gate, "_platform", lambda: ("cpu", None, "0.0-test"))
    _, info = gate.gated_start(cfg, start, inputs, say=lambda m: None)
    assert "runs on cpu, not a CUDA GPU" in info.settings["precision"]["reason"]
