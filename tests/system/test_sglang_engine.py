"""engine.kind: sglang end to end: ``batch-llm run`` of the demo pipeline in an SGLang environment, through plan,
the shard on SGLang's engine (chunked commits, the result cache), the content filter, EvalScope and publish.

Runs where ``BATCH_LLM_SGLANG_PYTHON`` names an interpreter that imports both SGLang and this project (on a GPU host:
the SGLang environment of docs/engines-and-gpus.md); skipped elsewhere, CI's CPU machine included, where no registry
package gives SGLang an engine (the same page says why, and how it ran here by hand: sglang 0.5.19, 8.5 minutes on
2 busy cores). ``tests/unit/test_sglang_settings.py`` tests the engine module without SGLang."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers import DEMO_YAML, run_in_group

SGLANG_PYTHON = os.environ.get("BATCH_LLM_SGLANG_PYTHON")
pytestmark = pytest.mark.skipif(not SGLANG_PYTHON, reason="no SGLang environment: set BATCH_LLM_SGLANG_PYTHON "
                                "(docs/engines-and-gpus.md, SGLang's environment)")


def test_the_demo_pipeline_runs_on_sglang(tmp_path):
    out = tmp_path / "out"
    run = run_in_group(
        [SGLANG_PYTHON, "-m", "batch_llm", "run", str(DEMO_YAML), "--output", str(out), "--ds", "2026-12-04",
         "--run-id", "sgl", "--plain", "--set", "engine.kind=sglang", "--set", "sharding.num_shards=1",
         "--set", "engine.max_num_seqs=16", "--set", "engine.sglang.max_total_tokens=16384",
         "--set", "engine.gpu_memory_utilization=0.5"],
        timeout=1500, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    [manifest] = out.glob("batch_llm_demo/runs/dt=2026-12-04/sgl/infer/shard-*/manifest.json")
    m = json.loads(manifest.read_text())
    assert m["engine"]["kind"] == "sglang" and m["engine"]["version"]
    assert m["metrics"]["rows"] == m["metrics"]["ok"] == 20 and m["metrics"]["output_tokens"] > 0
    [data] = out.glob("batch_llm_demo/dt=2026-12-04/v-*/data.jsonl")
    rows = [json.loads(line) for line in Path(data).read_text().splitlines()]
    assert len(rows) == 20
    assert all(r["output"] and r["finish_reason"] in ("stop", "length") and r["completion_tokens"] > 0 for r in rows)
    # greedy on the demo model: the first sample prompt's answer, as vLLM's CPU engine gives it (its city masked by
    # the demo's watchlist)
    assert next(r for r in rows if r["id"] == "q000")["output"].startswith("The capital of France is")
