"""``batch-llm run`` on the real CPU vLLM engine is quiet: on a terminal (a pseudo-terminal here, so the progress
bar is drawn as a person sees it) no vLLM or transformers log line, all of them (the engine core process's
included) in the run's log file, whose path is the first line printed; ``--verbose`` puts them back on the
terminal. The same with stub libraries, piped and on a terminal, in seconds: ``tests/unit/test_cli_quiet.py``."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from helpers import run_in_group, run_in_pty

ROOT = Path(__file__).resolve().parents[2]
DEMO_YAML = ROOT / "dags" / "pipelines" / "demo.yaml"
# vLLM's log format, coloured or not: "(EngineCore_DP0 pid=7) INFO 11-30 12:00:01 [core.py:95] ..."
VLLM_LINE = re.compile(r"(INFO|WARNING|DEBUG) \d\d-\d\d \d\d:\d\d:\d\d \[")


def _argv(out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "batch_llm", "run", str(DEMO_YAML), "--output", str(out), "--ds", "2026-11-08",
            "--run-id", "quiet", "--set", "sampling.max_tokens=8", "--set", "sharding.num_shards=1",
            "--set", "evaluate.enabled=false", "--set", "cache.enabled=false", *extra]


def _run(out: Path, *extra: str) -> subprocess.CompletedProcess:
    return run_in_group(_argv(out, "--plain", *extra), timeout=900)


def test_vllm_run_on_a_terminal_shows_progress_and_logs_the_engine(tmp_path, demo_model_dir):
    rc, terminal = run_in_pty(_argv(tmp_path / "out"), timeout=900)
    assert rc == 0, terminal[-3000:]
    assert not VLLM_LINE.search(terminal), terminal  # none of vLLM's ~34 start-up lines over the bar
    assert "EngineCore" not in terminal and "[transformers]" not in terminal and "Warning" not in terminal
    assert "\x1b[" in terminal and "20/20" in terminal and "tok/s" in terminal, terminal  # the bar, at its end
    assert "published 20 rows" in terminal
    first = terminal.lstrip().splitlines()[0]
    assert first.startswith("engine logs: "), terminal
    log = Path(first.removeprefix("engine logs: ").split(" (--verbose")[0]).read_text()
    assert len(VLLM_LINE.findall(log)) >= 10, log  # vLLM's start-up (its engine core runs in this process on CPU)
    assert "] progress:" in log  # the stages' messages, in order with the engine's


def test_vllm_run_verbose_shows_the_engine_logs(tmp_path, demo_model_dir):
    run = _run(tmp_path / "out", "--verbose")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert VLLM_LINE.search(run.stdout + run.stderr) and "engine logs:" not in run.stdout
