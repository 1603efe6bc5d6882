"""The ``batch-llm`` command: argument parsing, ``validate``, ``report`` / ``doctor`` on a finished run, and the
progress display. The engine-backed ``run`` is exercised elsewhere (it starts vLLM)."""
from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest
from batch_llm.frontends.cli import PROGRESS, Reporter, build_parser, config_from_args, find_summary, main
from batch_llm.io.storage import Location, write_json, write_manifest
from batch_llm.manifests import RunSummary
from helpers import run_in_group

ROOT = Path(__file__).resolve().parents[2]
DEMO_YAML = ROOT / "dags" / "pipelines" / "demo.yaml"
DEMO_OUTPUT = ROOT / "var" / "output" / "batch_llm_demo"


@pytest.fixture(autouse=True)
def _no_pool_gpus(monkeypatch):
    monkeypatch.setenv("BATCH_LLM_GPUS", "")


# ------------------------------------------------------------------------------------------ parsing
def test_run_arguments():
    a = build_parser().parse_args(["run", "p.yaml", "--input", "in/", "--output", "s3://b/out", "--ds", "2026-11-30",
                                   "--set", "engine.max_num_seqs=512", "--set", "sampling.stop=[a, b]",
                                   "--set", "model.chat_template=", "--set", "evaluate.min_score=null"])
    assert (a.command, a.config, a.input, a.output, a.ds) == ("run", "p.yaml", "in/", "s3://b/out", "2026-11-30")
    assert a.overrides == [("engine.max_num_seqs", 512), ("sampling.stop", ["a", "b"]), ("model.chat_template", ""),
                           ("evaluate.min_score", None)]
    a = build_parser().parse_args(["run-shard", "p.yaml", "--shard", "3", "--run-id", "cli__x"])
    assert (a.shard, a.run_id, a.ds) == (3, "cli__x", None)


def test_run_shard_tells_how_to_finish_the_run():
    from batch_llm.frontends.cli import finish_command

    argv = ["run-shard", "p.yaml", "--shard", "2", "--output", "/o", "--set", "a.b=1 2"]
    a = build_parser().parse_args(argv)
    a.argv = argv
    assert finish_command(a, "cli__2026-11-30", "2026-11-30") == \
        "batch-llm run p.yaml --output /o --set 'a.b=1 2' --run-id cli__2026-11-30 --ds 2026-11-30"


@pytest.mark.parametrize("argv", [["run", "p.yaml", "--ds", "30/11/2026"], ["run", "p.yaml", "--set", "novalue"],
                                  ["run-shard", "p.yaml"], ["frobnicate"], []])
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2


def test_overrides_reach_the_config(tmp_path):
    a = build_parser().parse_args(["run", str(DEMO_YAML), "--output", str(tmp_path / "o"), "--input", "rel/in.jsonl",
                                   "--set", "engine.max_num_seqs=512", "--set", "sharding.num_shards=4"])
    cfg = config_from_args(a)
    assert cfg.engine.max_num_seqs == 512 and cfg.sharding.num_shards == 4
    assert cfg.output.path == str(tmp_path / "o")
    assert Path(cfg.input.path).is_absolute() and cfg.input.path.endswith("rel/in.jsonl")


# ------------------------------------------------------------------------------------------ validate
def test_validate_good(capsys):
    assert main(["validate", str(DEMO_YAML)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("OK: ") and "batch_llm_demo" in out


def test_validate_bad_value_names_file_and_key(tmp_path, capsys):
    bad = tmp_path / "daily.yaml"
    bad.write_text(DEMO_YAML.read_text().replace("max_model_len: 1024",
                                                 "max_model_len: 1024\n  gpu_memory_utilization: 1.5"))
    assert main(["validate", str(bad)]) == 1
    err = capsys.readouterr().err
    assert f"{bad}: engine.gpu_memory_utilization:" in err and "less than or equal to 1" in err


def test_validate_unknown_key_and_broken_yaml(tmp_path, capsys):
    typo = tmp_path / "typo.yaml"
    typo.write_text(DEMO_YAML.read_text().replace("max_model_len:", "max_model_lenght:"))
    assert main(["validate", str(typo)]) == 1
    assert f"{typo}: engine.max_model_lenght:" in capsys.readouterr().err
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: x\nmodel: {ref: [unclosed\n")
    assert main(["validate", str(broken)]) == 1
    assert f"{broken}: not valid YAML" in capsys.readouterr().err
    assert main(["validate", str(tmp_path / "missing.yaml")]) == 1
    assert "missing.yaml" in capsys.readouterr().err


def test_validate_with_a_bad_override(capsys):
    assert main(["validate", str(DEMO_YAML), "--set", "engine.max_num_seqs=0"]) == 1
    assert "engine.max_num_seqs: Input should be greater than 0" in capsys.readouterr().err


def test_python_dash_m(tmp_path):
    r = subprocess.run([sys.executable, "-m", "batch_llm", "validate", str(DEMO_YAML)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("OK: "), r.stderr


# ------------------------------------------------------------------------------------------ report / doctor
@pytest.fixture
def published(tmp_path):
    """A published run to point the commands at: the demo run's summary (its shards' files are read where
    they are) copied into a partition of its own, or a synthetic run when the demo has not run here."""
    demo = sorted(DEMO_OUTPUT.glob("dt=*/v-*/summary.json"))
    if demo:
        summary = RunSummary.read(demo[-1])
        pipe = Location(str(tmp_path / "batch_llm_demo"))
        version = pipe.child(summary.partition, "v-copy")
        source = "demo"
    else:
        from synthetic_runs import make_run

        summary, version, pipe = make_run(tmp_path, 3)
        source = "synthetic"
    summary.write(version.path())
    part = Location(version.url.rsplit("/", 1)[0])
    write_json(part.child("_CURRENT.json").path(), {"version": version.url})
    run_dir = pipe.child("runs", summary.partition, "r")
    write_manifest(run_dir.child("publish").path(), {"summary": version.child("summary.json").url})
    return {"summary": summary, "version": version, "partition": part, "pipe": pipe, "run": run_dir, "source": source}


def test_find_summary_from_every_kind_of_target(published):
    v = published["version"]
    for target in (v.child("summary.json").url, v.url, published["partition"].url, published["run"].url,
                   published["pipe"].url):
        summary, version, root = find_summary(target)
        assert version.url == v.url and root.url == published["pipe"].url, target
        assert summary.run_id == published["summary"].run_id
    with pytest.raises(FileNotFoundError, match="no run summary here"):
        find_summary(str(Path(published["pipe"].url).parent / "nothing"))


def test_report_writes_then_shows(published, capsys):
    assert main(["report", published["partition"].url]) == 0
    out = capsys.readouterr().out
    report = Path(published["version"].child("report.html").url)
    assert f"report written: {report}" in out and report.exists()
    assert "finding" in out.lower()
    page = report.read_text()
    assert page.count("data:image/png;base64,") >= 5 and 'id="doctor"' in page
    stamp = report.stat().st_mtime_ns
    assert main(["report", published["partition"].url]) == 0
    assert f"report: {report}" in capsys.readouterr().out
    assert report.stat().st_mtime_ns == stamp                       # shown, not rewritten


def test_doctor(published, capsys):
    assert main(["doctor", published["version"].url]) == 0
    out = capsys.readouterr().out
    assert published["summary"].pipeline in out
    assert "No findings" in out or ("evidence:" in out and "change:" in out)
    if published["source"] == "demo":
        # The demo rejects 4 of its 24 input rows on purpose: the doctor must say so, with the numbers.
        assert "input rows rejected by the planner" in out and "4 of 24" in out


def test_doctor_gpus_argument(published, capsys):
    if published["source"] == "synthetic":
        assert main(["doctor", published["version"].url, "--gpus", "8"]) == 0
        assert "sharding.num_shards: 8" in capsys.readouterr().out    # 3 shards for 8 GPUs
    else:
        assert main(["doctor", published["version"].url, "--gpus", "4"]) == 0
        assert "fewer shards than GPUs" in capsys.readouterr().out    # the demo's 2 shards for 4 GPUs


def test_report_on_a_missing_target(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nowhere")]) == 1
    assert "nowhere" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ progress
LINE = "progress: 10/20 rows, 35.0 output tok/s, ETA 3s"


def test_progress_line_format_matches_the_shard_runner():
    import inspect

    from batch_llm.stages.infer import runner

    assert 'f"progress: {self.done}/{self.total} rows, {self.out_tokens / el:.1f} output tok/s, "' in \
        inspect.getsource(runner.Progress.tick)
    m = PROGRESS.search(LINE)
    assert m and m.groups() == ("10", "20", "35.0", "3")
    assert PROGRESS.search("progress: 0/20 rows, 0.0 output tok/s, ETA infs").group(4) == "inf"


def test_reporter_plain_lines_without_a_terminal():
    out = io.StringIO()
    with Reporter(tty=False, stream=out) as rep:
        rep.begin("shard 0", 20)
        rep.say(LINE)
        rep.say("engine vllm started")
        rep.end()
    assert out.getvalue().splitlines() == ["shard 0: 20 rows", LINE, "engine vllm started"]


def test_reporter_progress_bar_on_a_terminal():
    out = io.StringIO()
    with Reporter(tty=True, stream=out) as rep:
        rep.begin("shard 0", 20)
        rep.say(LINE)
        task = rep._progress.tasks[0]
        assert (task.completed, task.total, task.fields["tps"], task.fields["eta"]) == (10, 20, "35.0", "3s")
        rep.say("engine vllm started")
        rep.end()
        assert rep._progress.tasks[0].completed == 20
    text = out.getvalue()
    assert "engine vllm started" in text and "shard 0" in text
    assert LINE not in text                                          # drawn as a bar, not printed


def test_console_script_is_declared():
    assert 'batch-llm = "batch_llm.frontends.cli:main"' in (ROOT / "pyproject.toml").read_text()


def test_cli_run_end_to_end_then_report_and_doctor(tmp_path, demo_model_dir):
    """``batch-llm run`` through the same stages (transformers engine: seconds to start), then ``report``."""
    import json

    out = tmp_path / "cli_out"
    run = run_in_group(
        [sys.executable, "-m", "batch_llm", "run", str(DEMO_YAML), "--output", str(out), "--ds", "2026-11-07",
         "--plain", "--set", "engine.kind=transformers", "--set", "sampling.max_tokens=12",
         "--set", "sharding.num_shards=1", "--set", "evaluate.enabled=false"],
        timeout=900)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "progress:" in run.stdout
    current = json.loads((out / "batch_llm_demo" / "dt=2026-11-07" / "_CURRENT.json").read_text())
    rows = [json.loads(x) for x in open(current["dataset"].removeprefix("file://"))]
    assert len(rows) == 20 and all(r["output"].strip() for r in rows)
    assert (out / "batch_llm_demo" / "dt=2026-11-07").exists() and current.get("report")
    rep = subprocess.run([sys.executable, "-m", "batch_llm", "report", str(out / "batch_llm_demo")],
                         capture_output=True, text=True, timeout=300)
    assert rep.returncode == 0 and "report.html" in rep.stdout, rep.stdout + rep.stderr
