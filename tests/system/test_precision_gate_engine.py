"""engine.precision: auto on the real CPU vLLM engine, through `batch-llm run`: the calibration runs the sample in
both precisions (the candidate here is bfloat16 against the demo model's float32, the one lower precision a CPU
has), the decision and its agreement land in the shard manifest, and a later run of the same pipeline reuses the
stored decision without calibrating again. FP8 needs a GPU (docs/benchmarks.md measures it there)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from helpers import ROOT, run_in_group

DEMO_YAML = ROOT / "dags" / "pipelines" / "demo.yaml"
GATE = "{candidate: {dtype: bfloat16}, sample_rows: 4, max_tokens: 12, min_agreement: 0.5}"


def run(tmp: Path, ds: str) -> dict:
    proc = run_in_group(
        [sys.executable, "-m", "batch_llm", "run", str(DEMO_YAML), "--plain", "--ds", ds,
         "--input", str(tmp / "in.jsonl"), "--output", str(tmp / "out"),
         "--set", "sharding.num_shards=1", "--set", "evaluate.enabled=false", "--set", "sampling.max_tokens=12",
         "--set", "cache.enabled=false",  # the later run generates again (the decision is kept all the same)
         "--set", "engine.precision=auto", "--set", f"engine.precision_gate={GATE}"],
        timeout=600, cwd=ROOT, env={**os.environ, "BATCH_LLM_GPUS": ""})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    manifests = list((tmp / "out").glob(f"batch_llm_demo/runs/dt={ds}/*/infer/shard-00000/manifest.json"))
    assert len(manifests) == 1, proc.stdout[-2000:]
    m = json.loads(manifests[0].read_text())
    assert m["metrics"]["rows"] == 6 and m["metrics"]["errors"] == 0
    return {"settings": m["engine"]["settings"], "stdout": proc.stdout}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("precision")
    lines = (ROOT / "include" / "sample_data" / "demo_prompts.jsonl").read_text().splitlines()
    rows = [json.loads(x) for x in lines if x.strip().startswith("{\"id\": \"q0")][:6]
    (tmp / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp, run(tmp, "2026-01-01"), run(tmp, "2026-01-02")


def test_the_calibration_decides_and_the_manifest_says_so(runs):
    tmp, first, _ = runs
    rec = first["settings"]["precision"]
    assert rec["device"] == "cpu" and rec["candidate"] == {"dtype": "bfloat16"} and rec["sample_rows"] == 4
    assert 0.0 <= rec["agreement"] <= 1.0 and rec["max_tokens"] == 12
    # the decision follows the measured agreement, and the serving engine runs the decided precision
    assert rec["decision"] == ("candidate" if rec["agreement"] >= 0.5 else "model")
    assert first["settings"]["dtype"] == ("bfloat16" if rec["decision"] == "candidate" else "float32")
    assert "precision: " in first["stdout"]
    stored = list((tmp / "out").glob("_cache/results/precision/*.json"))
    assert len(stored) == 1 and json.loads(stored[0].read_text())["decision"] == rec["decision"]


def test_a_later_run_reuses_the_decision(runs):
    _, first, second = runs
    rec = second["settings"]["precision"]
    assert rec["from_cache"] is True and rec["decision"] == first["settings"]["precision"]["decision"]
    assert "decided before" in second["stdout"]
    assert second["settings"]["dtype"] == first["settings"]["dtype"]
