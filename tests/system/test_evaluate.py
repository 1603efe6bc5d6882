"""score_with_evalscope against the real EvalScope, offline: replayed outputs, reports on disk, per-sample scores."""
import json
import logging
import os
import random
import sys
import tempfile
from pathlib import Path

import pytest
from batch_llm.stages.evaluate import score_with_evalscope

EXACT = [
    {"id": "e1", "question": "What is the capital of France?", "reference": "The capital of France is Paris."},
    {"id": "e2", "question": "How many legs does a spider have?", "reference": "A spider has eight legs."},
    {"id": "e3", "question": "中国的首都是哪里？", "reference": "北京是中国的首都。"},  # jieba path
]
UNRELATED = [
    # Same question as e1: the output must be found by id, not by question text.
    {"id": "u1", "question": "What is the capital of France?", "reference": "The capital of France is Paris.",
     "output": "Bananas grow quickly in warm climates."},
    {"id": "u2", "question": "Name a primary colour.", "reference": "Red is a primary colour.",
     "output": "Quantum tunnelling permits barrier crossing."},
    {"id": "u3", "question": "What does a thermometer measure?", "reference": "A thermometer measures temperature.",
     "output": "Jazz originated around New Orleans."},
]
MIXED = [dict(r, output=r["reference"]) for r in EXACT] + UNRELATED

# Audit hook (cannot be removed once added): records network use and file writes while `_audit` is not None.
_audit: list | None = None
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND


def _hook(event, args):
    if _audit is None:
        return
    if event in ("socket.connect", "socket.getaddrinfo", "socket.gethostbyname"):
        _audit.append((event, args[:2]))
    elif event == "open" and isinstance(args[0], (str, Path)):
        mode, flags = args[1], args[2]
        if (isinstance(mode, str) and any(c in mode for c in "wax+")) or (mode is None and flags & _WRITE_FLAGS):
            _audit.append(("write", str(args[0])))


sys.addaudithook(_hook)


def test_offline_no_writes_outside_work_dir_and_no_leaks(tmp_path):
    """First in the file, so it covers EvalScope's first import in this process too."""
    global _audit
    env = dict(os.environ)
    root_handlers = logging.getLogger().handlers[:]
    _audit = []
    try:
        result = score_with_evalscope(MIXED, tmp_path / "eval")
    finally:
        events, _audit = _audit, None

    network = [e for e in events if e[0] != "write"]
    assert network == []
    allowed = (str(tmp_path), os.path.join(tempfile.gettempdir(), "batch_llm_evalscope_"), "/dev/")
    assert [p for kind, p in events if kind == "write" and not p.startswith(allowed)] == []
    assert dict(os.environ) == env
    assert logging.getLogger().handlers == root_handlers
    assert not [h for h in logging.getLogger("evalscope").handlers if isinstance(h, logging.FileHandler)]
    import nltk

    assert not any("batch_llm_evalscope_" in p for p in nltk.data.path)
    assert result["num_samples"] == len(MIXED)


def test_mixed_outputs(tmp_path):
    import evalscope.run  # noqa: F401  (importing it draws random numbers; a run must not reseed them)

    random.seed("not EvalScope's 42")
    rng_state = random.getstate()
    result = score_with_evalscope(MIXED, tmp_path / "eval", metric="rouge-l-f")
    assert random.getstate() == rng_state

    report = Path(result["report_json"])
    assert report.is_file() and report.is_relative_to(tmp_path)
    assert json.loads(report.read_text())["metrics"]
    assert result["report_html"] and Path(result["report_html"]).is_file()
    assert result["evalscope_version"] == "1.14.1"
    assert result["num_samples"] == 6
    assert result["metric"] == "Rouge-L-F"  # normalized from "rouge-l-f"
    assert result["metric_errors"] == {}  # BLEU computed, not silently 0

    names = {f"Rouge-{n}-{s}" for n in "12L" for s in "RPF"} | {f"bleu-{n}" for n in range(1, 5)}
    assert set(result["metrics"]) == names
    for value in result["metrics"].values():
        assert isinstance(value, float) and 0.0 <= value <= 1.0
    assert 0.0 < result["score"] < 1.0
    assert result["score"] == result["metrics"]["Rouge-L-F"]

    per = result["per_sample"]
    assert set(per) == {r["id"] for r in MIXED}
    for r in EXACT:
        assert per[r["id"]]["Rouge-L-F"] > 0.999, r["id"]
        assert per[r["id"]]["bleu-4"] == pytest.approx(1.0), r["id"]
    for r in UNRELATED:
        assert per[r["id"]]["Rouge-L-F"] == 0.0, r["id"]
        assert per[r["id"]]["bleu-1"] < 0.5, r["id"]
    # The report's aggregate is the mean of the per-sample scores (the report rounds to 4 decimals).
    for name in names:
        mean = sum(s[name] for s in per.values()) / len(per)
        assert result["metrics"][name] == pytest.approx(mean, abs=1e-4), name


def test_all_outputs_equal_references(tmp_path):
    result = score_with_evalscope([dict(r, output=r["reference"]) for r in EXACT + UNRELATED], tmp_path)

    assert result["num_samples"] == 6
    assert result["metric"] == "Rouge-L-F"
    for name, value in result["metrics"].items():
        assert value == pytest.approx(1.0, abs=1e-4), name


def test_unknown_metric_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"unknown metric .accuracy.; EvalScope.s general_qa reports .*Rouge-L-F"):
        score_with_evalscope(MIXED, tmp_path, metric="accuracy")


def test_missing_report_is_an_error(tmp_path, monkeypatch):
    import evalscope

    monkeypatch.setattr(evalscope, "run_task", lambda task: {})
    with pytest.raises(RuntimeError, match="no report"):
        score_with_evalscope(MIXED, tmp_path)
