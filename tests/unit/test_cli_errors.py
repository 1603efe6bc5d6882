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


def test_validate_accepts_the_file_and_warns_that_the_engine_is_not_here(absent_engine, capsys):
    """The file may be for a machine that has the engine (a GPU worker): validate passes it and says, in one
    warning line, what running it here would need."""
    rc = main(["validate", str(DEMO), "--set", f"engine.kind={absent_engine}"])
    out, err = capsys.readouterr()
    assert rc == 0 and out.startswith("OK: ")
    assert [x for x in err.splitlines() if ABSENT in x] == [
        x for x in err.splitlines() if x.startswith("warning: engine.kind absent:") and "batch-llm[absent]" in x]
    assert any(ABSENT in x for x in err.splitlines())


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


# ------------------------------------------------------------------------------------------ doctor and report
def pipeline_file(tmp_path, name: str = "pipe", table: bool = False) -> Path:
    """A pipeline YAML whose output.path is ``tmp_path`` (relative, as the README's demo.yaml has it)."""
    cfg = tmp_path / "conf" / f"{name}.yaml"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    table_section = "\n  table: {format: iceberg, name: ns.answers}" if table else ""
    cfg.write_text(f"name: {name}\nmodel: {{ref: some/model}}\ninput: {{path: rows.jsonl}}\n"
                   f"output:\n  path: ../{table_section}\n")
    return cfg


def published_run(tmp_path):
    """A run published as file versions: its summary in the partition's version, _CURRENT.json naming it."""
    from batch_llm.io.storage import write_json
    from synthetic_runs import make_run

    summary, version, pipe = make_run(tmp_path, 2)
    summary.write(version.path())
    write_json(pipe.child(summary.partition, "_CURRENT.json").path(), {"version": version.url})
    return summary, version, pipe


def table_run(tmp_path, run_ids=("r0", "r1")):
    """Runs of a table pipeline: no partition folders (the rows went to the table), each run's summary in its
    publish folder; the last of ``run_ids`` published last."""
    import datetime as dt

    from synthetic_runs import make_run

    summary, _, pipe = make_run(tmp_path, 2, earlier=())
    for k, run_id in enumerate(run_ids):
        at = dt.datetime(2026, 12, 3, 10 + k, tzinfo=dt.timezone.utc)
        s = summary.model_copy(update={"run_id": run_id, "published_at": at})
        s.write(pipe.child("runs", summary.partition, run_id, "publish").path())
    return summary, pipe


@pytest.mark.parametrize("command", ["doctor", "report"])
def test_doctor_and_report_take_the_pipeline_yaml(command, tmp_path, capsys):
    """`batch-llm doctor|report <pipeline>.yaml`, as the README prints them: the pipeline's latest partition."""
    summary, version, _ = published_run(tmp_path)
    rc = main([command, str(pipeline_file(tmp_path))])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "Traceback" not in err and "error" not in err
    if command == "doctor":
        assert f"{summary.partition} (run {summary.run_id})" in out
    else:
        assert f"report written: {version.child('report.html').url}" in out
        assert (Path(version.path()) / "report.html").is_file()


@pytest.mark.parametrize("target", ["yaml", "folder"])
def test_doctor_and_report_on_a_table_pipeline_read_its_latest_published_run(target, tmp_path, capsys):
    """A table pipeline keeps its summaries in its runs' publish folders: the latest published run is found
    from the pipeline file or folder, and its report is written beside its summary."""
    from batch_llm.frontends.cli import find_summary

    summary, pipe = table_run(tmp_path)
    where = str(pipeline_file(tmp_path, table=True)) if target == "yaml" else str(Path(pipe.path()))
    found, version, root = find_summary(where)
    assert found.run_id == "r1" and root.url == pipe.url
    assert main(["doctor", where]) == 0
    assert f"{summary.partition} (run r1)" in capsys.readouterr().out
    assert main(["report", where]) == 0
    assert (Path(pipe.path()) / "runs" / summary.partition / "r1" / "publish" / "report.html").is_file()


def test_doctor_on_a_pipeline_without_a_published_run_is_one_line(tmp_path, capsys):
    rc = main(["doctor", str(pipeline_file(tmp_path))])
    line = one_error_line(capsys)
    assert rc == 1 and "no run summary here" in line and "once a run published" in line
