"""Errors of the `batch-llm` commands that say what to do, in one line, without a traceback: an engine whose
package is not installed where it would start (the extra to install, or engine.python), refused before any work;
an engine run under another interpreter (engine.python) is not checked here."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from batch_llm.config.capabilities import EngineCapabilities, register_capabilities, unregister_capabilities
from batch_llm.frontends.cli import main

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "dags" / "pipelines" / "demo.yaml"
ABSENT = "batch_llm_engine_package_that_is_not_installed"


@pytest.fixture
def absent_engine():
    """An engine kind whose package is not installed here (its row names the package and the extra)."""
    register_capabilities(EngineCapabilities("absent", "batch_llm_absent_engine", title="Absent",
                                             packages=(ABSENT,), extras=("absent",)))
    yield "absent"
    unregister_capabilities("absent")


def one_error_line(capsys) -> str:
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ")
    return lines[0]


@pytest.mark.parametrize("command", [["run"], ["run-shard", "--shard", "0"]])
def test_an_engine_not_installed_is_one_line_naming_the_extra_and_engine_python(command, absent_engine, tmp_path,
                                                                                  capsys):
    rc = main([*command, str(DEMO), "--set", f"engine.kind={absent_engine}", "--output", str(tmp_path / "out")])
    line = one_error_line(capsys)
    assert rc == 2
    assert "engine.kind absent:" in line and ABSENT in line
    assert "pip install 'batch-llm[absent]'" in line and "engine.python" in line
    assert not (tmp_path / "out").exists()  # refused before anything is written


def test_an_engine_under_another_interpreter_is_not_checked_here(absent_engine, tmp_path, capsys):
    """engine.python: the engine's packages are that environment's; the run goes on to its next check (here an
    output path that is a file, refused in its own line)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    rc = main(["run", str(DEMO), "--set", f"engine.kind={absent_engine}",
               "--set", f"engine.python={tmp_path / 'other-env' / 'bin' / 'python'}", "--output", str(blocker)])
    line = one_error_line(capsys)
    assert rc == 1
    assert line.startswith("error: output.path:") and ABSENT not in line


@pytest.mark.parametrize("backend", ["sglang", "lmdeploy"])
def test_infer_backend_not_installed_is_one_line(backend, tmp_path, capsys):
    """`batch-llm infer --infer_backend sglang|lmdeploy` where that engine is not installed: refused before any
    row is read, naming the flag, the extra and engine.python."""
    if importlib.util.find_spec(backend) is not None:
        pytest.skip(f"{backend} is installed here")
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    rc = main(["infer", "--model", str(tmp_path / "model"), "--infer_backend", backend, "--val_dataset", str(rows),
               "--result_path", str(tmp_path / "out.jsonl")])
    line = one_error_line(capsys)
    assert rc == 2
    assert f"--infer_backend {backend}" in line
    assert f"pip install 'batch-llm[{backend}]'" in line and "engine.python" in line
    assert not (tmp_path / "out.jsonl").exists()
