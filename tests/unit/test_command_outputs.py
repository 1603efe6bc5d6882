"""Every command checks where it will write before it works, and every run id is checked where it enters.

An output that is a folder, in a missing or unwritable folder, or the input itself is refused at once, in one
line, before any model is fetched or any engine starts; a failure after a run never deletes what the run finished
(the work folder is kept and named). A run id that could not name one run folder (``..``, a path, a control
character, too long) is refused by the command line, by ``RunLayout.for_run`` and by the Airflow operators. No
engine."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from batch_llm.config import ConfigError
from batch_llm.frontends import cli, run_batch, swift
from batch_llm.frontends.cli import main
from batch_llm.host import path_policy
from helpers import DEMO_YAML, demo_config


def _no_run(*args, **kwargs):
    raise AssertionError("the command ran although its output could not be written")


@pytest.fixture
def model(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    return folder


@pytest.fixture
def requests(tmp_path: Path) -> Path:
    src = tmp_path / "requests.jsonl"
    src.write_text(json.dumps({"custom_id": "a", "body": {"messages": [{"role": "user", "content": "hi"}]}}) + "\n")
    return src


def _unwritable_folder(tmp_path: Path) -> Path:
    """A folder no file can be made in: a read-only one, or (as root, who writes anywhere) /sys."""
    folder = tmp_path / "readonly"
    folder.mkdir()
    folder.chmod(0o500)
    if path_policy.folder_writable(str(folder)):
        folder = Path("/sys")
        if not folder.is_dir() or path_policy.folder_writable(str(folder)):
            pytest.skip("no folder here refuses a new file")
    return folder


def _bad_outputs(tmp_path: Path, src: Path) -> list[tuple[str, str]]:
    (tmp_path / "a_folder").mkdir()
    return [(str(tmp_path / "a_folder"), "is a folder"),
            (str(tmp_path / "missing" / "out.jsonl"), "does not exist"),
            (str(src), "is the input"),
            (str(_unwritable_folder(tmp_path) / "out.jsonl"), "is not writable")]


def test_run_batch_refuses_an_output_it_could_not_write_before_any_work(tmp_path, model, requests, monkeypatch,
                                                                        capsys):
    monkeypatch.setattr(run_batch, "run_written_config", _no_run)
    monkeypatch.setattr(run_batch, "build_config", _no_run)  # not even the model's generation config is read
    for out, why in _bad_outputs(tmp_path, requests):
        assert main(["run-batch", "-i", str(requests), "-o", out, "--model", str(model)]) == 1
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"error: -o {out}") and why in err and len(err.splitlines()) == 1, err


def test_infer_refuses_a_result_path_it_could_not_write_before_any_work(tmp_path, model, monkeypatch, capsys):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    monkeypatch.setattr(swift, "run_written_config", _no_run)
    for out, why in _bad_outputs(tmp_path, rows):
        argv = ["infer", "--model", str(model), "--val_dataset", f"{rows}#1", "--result_path", out]
        assert main(argv) == 1
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"error: --result_path {out}") and why in err and len(err.splitlines()) == 1, err


def test_run_refuses_an_output_folder_that_is_its_input_or_cannot_be_made(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "_prepare", _no_run)
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    (inputs / "rows.jsonl").write_text(json.dumps({"id": "1", "prompt": "hi"}) + "\n")
    for out, why in ((inputs, "is the input"), (_unwritable_folder(tmp_path) / "out", "is not writable")):
        assert main(["run", str(DEMO_YAML), "--input", str(inputs), "--output", str(out), "--plain"]) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: output.path") and why in err, err
        assert not (Path(out) / "batch_llm_demo").exists()


@pytest.mark.parametrize("command", ["run-batch", "infer"])
def test_a_failure_after_the_run_keeps_the_work_folder_and_names_it(command, tmp_path, model, requests, monkeypatch,
                                                                    capsys):
    """The run finished (a file stands for its results) but writing the command's output failed: the temporary
    work folder, and what the run left there, stay."""
    def finished_run(config_path, run, outer, **kwargs):
        (Path(config_path).parent / "output").mkdir(exist_ok=True)
        (Path(config_path).parent / "output" / "results.jsonl").write_text("finished\n")
        return 0, "2026-12-06"  # but nothing was published: reading the results fails

    out = tmp_path / "out.jsonl"
    if command == "run-batch":
        monkeypatch.setattr(run_batch, "run_written_config", finished_run)
        argv = ["run-batch", "-i", str(requests), "-o", str(out), "--model", str(model)]
    else:
        monkeypatch.setattr(swift, "run_written_config", finished_run)
        rows = tmp_path / "rows.jsonl"
        rows.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
        argv = ["infer", "--model", str(model), "--val_dataset", str(rows), "--result_path", str(out)]
    assert main(argv) == 1
    err = capsys.readouterr().err
    kept = [line.split("kept: ", 1)[1].split(" (", 1)[0] for line in err.splitlines() if "work folder is kept" in line]
    assert kept, err
    assert (Path(kept[0]) / "output" / "results.jsonl").read_text() == "finished\n"
    assert not out.exists()


def test_a_finished_command_removes_its_temporary_work_folder(tmp_path):
    from batch_llm.frontends.written_config import keep_work_folder

    for started, finished, stays in ((False, False, False), (True, True, False), (True, False, True)):
        work = tmp_path / f"w{started}{finished}"
        work.mkdir()
        keep_work_folder(work, keep=False, started=started, finished=finished)
        assert work.exists() is stays


BAD_RUN_IDS = {"parent": "..", "dot": ".", "slash": "a/b", "backslash": "a\\b", "newline": "a\nb",
               "escape": "a\x1bb", "delete": "a\x7fb", "empty": " ", "long": "r" * 251}


@pytest.mark.parametrize("run_id", BAD_RUN_IDS.values(), ids=BAD_RUN_IDS.keys())
def test_a_run_id_that_cannot_name_one_run_folder_is_refused_everywhere_it_enters(run_id, tmp_path, monkeypatch,
                                                                                  capsys):
    from airflow.sdk.exceptions import AirflowFailException
    from batch_llm.layout import RunLayout
    from batch_llm_airflow.operators import FetchModelOperator
    from test_operators import _context

    cfg = demo_config(tmp_path)
    with pytest.raises(ConfigError):
        RunLayout.for_run(cfg, run_id=run_id, ds="2026-11-30")
    ctx = _context()
    ctx["run_id"] = run_id  # a DAG run's id, as the REST API or the trigger form gave it
    op = FetchModelOperator(task_id="fetch_model", pipeline_config=cfg.model_dump(mode="json"))
    with pytest.raises(AirflowFailException, match="run id"):
        op.resolve(ctx)
    monkeypatch.setattr(cli, "_prepare", _no_run)
    out = tmp_path / "out"
    assert main(["run", str(DEMO_YAML), "--output", str(out), "--run-id", run_id, "--plain"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: --run-id: ") and len(err.strip().splitlines()) == 1, err
    assert not out.exists()  # not even the log file


@pytest.mark.parametrize("run_id", ["cli__2026-11-30", "manual__2026-11-30T12:00:00+00:00", "...", "r" * 250,
                                    "scheduled__x~y"])
def test_run_ids_airflow_and_the_cli_make_are_accepted(run_id, tmp_path):
    from batch_llm.layout import RunLayout

    assert path_policy.run_id_problem(run_id) is None
    layout = RunLayout.for_run(demo_config(tmp_path), run_id=run_id, ds="2026-11-30")
    assert layout.run_dir.path().parent.name == "dt=2026-11-30"


def test_output_file_problem_allows_an_existing_or_new_file_in_a_writable_folder(tmp_path):
    (tmp_path / "old.jsonl").write_text("")
    assert path_policy.output_file_problem(str(tmp_path / "old.jsonl"), (str(tmp_path / "in.jsonl"),)) is None
    assert path_policy.output_file_problem(str(tmp_path / "new.jsonl")) is None
    assert os.listdir(tmp_path) == ["old.jsonl"]  # the probe left nothing
