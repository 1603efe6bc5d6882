"""A shard worker's output sorted for people (``batch_llm.isolation.worker_log``): the worker marks its own
messages, every other line is the engine's; engine warnings become one line named by their source. The
Airflow task's side of it: ``tests/unit/test_operators.py``; a real run's task log:
``tests/system/test_pipeline_e2e.py``."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from batch_llm.io.storage import Location
from batch_llm.isolation.worker_log import EngineLog, engine_warning
from batch_llm.isolation.worker_parent import _WorkerOutput


@pytest.mark.parametrize(("line", "warning"), [
    ("\x1b[1;36m(EngineCore_DP0 pid=7)\x1b[0;0m \x1b[33mWARNING\x1b[0m 11-30 12:00:03 [cpu.py:1] Pin memory is off",
     "vllm: Pin memory is off"),
    ("WARNING 11-30 12:00:01 [config.py:9] Casting torch.bfloat16 to torch.float32.",
     "vllm: Casting torch.bfloat16 to torch.float32."),
    ("2026-11-30 12:00:01,123 WARNING py.warnings: /x/site-packages/torch/cuda/__init__.py:9: UserWarning: no CUDA",
     "torch: UserWarning: no CUDA"),
    ("/x/lib/python3.11/site-packages/transformers/utils.py:5: FutureWarning: renamed", "transformers: FutureWarning: "
                                                                                       "renamed"),
    ("2026-11-30 12:00:01,123 WARNING filelock: lock held", "filelock: lock held"),
    ("INFO 11-30 12:00:01 [llm.py:1] non-default args", None),
    ("2026-11-30 12:00:01,123 INFO httpx: GET /", None),
    ("Loading safetensors checkpoint shards: 100%", None),
])
def test_engine_warnings_are_one_line_named_by_their_source(line, warning):
    assert engine_warning(line) == warning


def test_the_worker_marks_its_own_messages_and_python_warnings_come_as_one_record(tmp_path):
    """The worker's logging set-up, in a process of its own as the worker runs it: batch_llm's loggers and its
    ``say`` are marked (warnings apart), a library's logger and a Python warning are the engine's, with their level."""
    script = textwrap.dedent("""
        import logging, warnings
        from batch_llm.isolation import worker_child as w
        w._log_setup()
        w._say("shard 0: 2 rows")
        logging.getLogger("batch_llm.stages.infer").info("starting it over")
        logging.getLogger("batch_llm.stages.infer").warning("PIPELINE-WARNING")
        logging.getLogger("somelib").warning("LIB-WARNING")
        logging.getLogger("somelib").info("LIB-INFO")
        warnings.warn("PY-WARNING")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60).stdout
    stage, warned, engine = [], [], []
    sink = _WorkerOutput(stage.append, engine.append, warned.append)
    for line in out.splitlines():
        sink.take(line)
    assert stage == ["shard 0: 2 rows", "starting it over"] and warned == ["PIPELINE-WARNING"], out
    assert [engine_warning(e) for e in engine if e.strip() and not e[:1].isspace()] == [
        "somelib: LIB-WARNING", None, "<string>: UserWarning: PY-WARNING"], engine


def test_the_engine_log_is_copied_to_a_run_folder_elsewhere(tmp_path, monkeypatch):
    """A run folder that is not on this machine (memory:// here, as S3 would be): the engine log is written
    locally, then copied there when the worker is done."""
    warned: list[str] = []
    run_dir = Location("memory://bucket/runs/r1")
    with EngineLog(run_dir, "batch_inference-0-try1", warn=warned.append) as log:
        log("INFO 11-30 12:00:01 [llm.py:1] started")
        log("WARNING 11-30 12:00:01 [llm.py:1] careful")
        log("WARNING 11-30 12:00:02 [llm.py:1] careful")  # again (vLLM: once per thread): the file only
    assert log.url == "memory://bucket/runs/r1/logs/batch_inference-0-try1.log"
    assert run_dir.child("logs", "batch_inference-0-try1.log").path().read_text().splitlines() == [
        "INFO 11-30 12:00:01 [llm.py:1] started", "WARNING 11-30 12:00:01 [llm.py:1] careful",
        "WARNING 11-30 12:00:02 [llm.py:1] careful"]
    assert warned == ["vllm: careful"] and (log.lines, log.warnings, log.repeats) == (3, 1, 1)
