"""The `batch-llm` program's exit after an in-process engine: the exit handlers run, the exit status is the
command's, and the interpreter's teardown of torch and vLLM is skipped (2-3 s of a 25 s `batch-llm infer` on a
2-core CPU); a process without torch, or with a non-daemon thread still running, exits the ordinary way."""
from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import atexit, sys, threading, time, types
if {torch}:
    sys.modules["torch"] = types.ModuleType("torch")  # what an in-process engine leaves loaded

class Teardown:
    def __del__(self):
        print("teardown ran", flush=True)

keep = Teardown()
atexit.register(lambda: print("exit handler ran", flush=True))
sys.argv = ["batch-llm", "validate", "/nonexistent/pipeline.yaml"]
from batch_llm.frontends.cli import main
if {thread}:  # started after the imports, so it outlives the command (a missing file: milliseconds)
    threading.Thread(target=time.sleep, args=(3,)).start()
rc = main()
print("main returned", rc, flush=True)
sys.exit(rc)
"""


@pytest.mark.parametrize("torch, thread, skipped", [(True, False, True), (False, False, False), (True, True, False)])
def test_the_program_exits_without_teardown_only_after_an_engine(torch, thread, skipped):
    run = subprocess.run([sys.executable, "-c", SCRIPT.format(torch=torch, thread=thread)], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 1, run.stderr  # validate's own status: the file is missing
    assert "exit handler ran" in run.stdout  # vLLM's shutdown and logging's flush are exit handlers
    assert ("main returned" in run.stdout) is not skipped
    assert ("teardown ran" in run.stdout) is not skipped


def test_a_call_from_python_returns_its_status():
    """Tests and other callers pass their arguments: main returns, the process goes on."""
    from batch_llm.frontends.cli import main

    assert main(["validate", "/nonexistent/pipeline.yaml"]) == 1
