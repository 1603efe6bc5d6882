"""``batch-llm run`` on the real CPU vLLM engine is quiet: no vLLM or transformers log line
on the terminal, all of them (the engine core process's included) in the run's log file, whose path is the
first line printed; ``--verbose`` puts them back on the terminal. The same with stub libraries, in seconds:
``tests/unit/test_cli_quiet.py``."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from helpers import run_in_group

ROOT = Path(__file__).resolve().parents[2]
DEMO_YAML = ROOT / "dags" / "pipelines" / "demo.yaml"
# vLLM's log format, coloured or not: "(EngineCore_DP0 pid=7) INFO 11-30 12:00:01 [core.py:95] ..."
VLLM_LINE = re.compile(r"(INFO|WARNING|DEBUG) \d\d-\d\d \d\d:\d\d:\d\d \[")


def _run(out: Path, *extra: str) -> subprocess.CompletedProcess:
    return run_in_group(
        [sys.executable, "-m", "batch_llm", "run", str(DEMO_YAML), "--output", str(out), "--ds", "2026-11-08",
         "--plain", "--run-id", "quiet", "--set", "sampling.max_tokens=8", "--set", "sharding.num_shards=1",
         "--set", "evaluate.enabled=false", "--set", "cache.enabled=false", *extra],
        timeout=900)


def test_vllm_run_logs_go_to_the_log_file(tmp_path, demo_model_dir):
    run = _run(tmp_path / "out")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    terminal = run.stdout + run.stderr
    assert not VLLM_LINE.search(terminal), terminal
    assert "EngineCore" not in terminal and "[transformers]" not in terminal
    assert "progress:" in run.stdout and "published 20 rows" in run.stdout
    first = run.stdout.splitlines()[0]
    assert first.startswith("engine logs: ")
    log = Path(first.removeprefix("engine logs: ").split(" (--verbose")[0]).read_text()
    assert VLLM_LINE.search(log)  # vLLM's own lines (on CPU its engine core runs in this process: no EngineCore)
    assert "] progress:" in log  # the stages' messages, in order with the engine's


def test_vllm_run_verbose_shows_the_engine_logs(tmp_path, demo_model_dir):
    run = _run(tmp_path / "out", "--verbose")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert VLLM_LINE.search(run.stdout + run.stderr) and "engine logs:" not in run.stdout
