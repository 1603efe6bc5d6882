"""``batch-llm run`` is quiet: the terminal shows the stages and the progress; what the engine
libraries print goes to the run's log file, whose path is printed first; ``--verbose`` shows everything.

The run is the real command (``batch_llm.frontends.cli.main`` in a process of its own, real file descriptors) over stub
stages whose shard writes as an engine does: a logger with a handler on ``sys.stdout`` (as vLLM configures its
own), transformers' logger (on ``sys.stderr``), a Python warning, a C-level write to descriptor 2, and a process
it spawns (as vLLM's engine core) writing to the descriptors it inherits. No engine starts here; the same check
with the real CPU vLLM engine is ``tests/system/test_cli_quiet_vllm.py``."""
from __future__ import annotations

import io
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from batch_llm.frontends.cli import Reporter, build_parser
from batch_llm.isolation.worker_log import engine_line
from helpers import run_in_pty

ROOT = Path(__file__).resolve().parents[2]
DEMO_YAML = ROOT / "dags" / "pipelines" / "demo.yaml"

SCRIPT = textwrap.dedent('''
    import logging, multiprocessing, os, sys, warnings
    from types import SimpleNamespace as NS


    def engine_core():  # a process the engine starts (vLLM's EngineCore): inherits descriptors 1 and 2
        print(f"(EngineCore_DP0 pid={os.getpid()}) INFO 11-30 12:00:02 [core.py:1] ENGINE-CORE-STDOUT", flush=True)
        print("ENGINE-CORE-STDERR", file=sys.stderr, flush=True)


    class ShardFailed(Exception):
        pass


    def infer_shard(cfg, layout, model, shard, say=print, **kw):
        log = logging.getLogger("vllm.fake")  # as vLLM configures its logger: a handler on sys.stdout
        h = logging.StreamHandler(sys.stdout)
        h.setFormatter(logging.Formatter("(%(processName)s pid=%(process)d) %(levelname)s 11-30 12:00:01 "
                                         "[llm.py:1] %(message)s"))
        log.addHandler(h)
        log.setLevel(logging.INFO)
        log.info("VLLM-INFO-LINE")
        from transformers.utils import logging as tl
        tl.set_verbosity_info()
        tl.get_logger("transformers.fake").info("TRANSFORMERS-INFO-LINE")
        warnings.warn("LIBRARY-WARNING")
        os.write(2, b"C-LEVEL-LINE\\n")
        child = multiprocessing.get_context("spawn").Process(target=engine_core)
        child.start()
        child.join()
        say("progress: 2/2 rows, 5.0 output tok/s, ETA 0s")
        say("shard 0: STAGE-MESSAGE")
        if os.environ.get("FAIL_SHARD"):
            raise ShardFailed("SHARD-FAILED-MESSAGE")
        return NS(shard=0)


    def stub_stages(summary_path):
        from batch_llm.frontends import cli
        from batch_llm.analysis import doctor
        from batch_llm import api
        from batch_llm import layout

        api.fetch = lambda cfg, layout: NS(id="m", cache_hit=True, total_bytes=1e6)
        api.quantize = lambda cfg, layout, model: NS(quantized=False, local_dir="m")
        api.plan_shards = lambda cfg, layout: NS(rows_read=2, valid=2, invalid=0, seconds=0.1,
                                                    shards=[NS(index=0, rows=2)])
        api.infer_shard = infer_shard
        api.content_filter = lambda *a: NS(summary=NS(rows_scanned=2, rows_affected=0, rows_dropped=0, review=None))
        api.evaluate = lambda *a: NS(num_samples=0, rows_with_references=0, sampled=False, skipped="off",
                                        metrics={})
        api.publish = lambda *a, **k: NS(rows=2, dataset="D", errors="E", error_rows=0, summary=summary_path,
                                            report=None)
        layout.read_manifest_at = lambda *a: None
        layout.shard_manifests = lambda *a: []
        cli.RunSummary = NS(read=lambda path: None)
        doctor.diagnose = lambda *a, **k: []
        doctor.format_findings = lambda findings: "DOCTOR-FINDINGS"


    if __name__ == "__main__":
        stub_stages(sys.argv[1])
        from batch_llm.frontends.cli import main
        sys.exit(main(sys.argv[2:]))
''')

LIBRARY_LINES = ["VLLM-INFO-LINE", "TRANSFORMERS-INFO-LINE", "LIBRARY-WARNING", "C-LEVEL-LINE",
                 "ENGINE-CORE-STDOUT", "ENGINE-CORE-STDERR"]


def _run(tmp_path: Path, *extra: str, fail: bool = False) -> subprocess.CompletedProcess:
    script = tmp_path / "quiet_run.py"
    script.write_text(SCRIPT)
    env = {**__import__("os").environ, "FAIL_SHARD": "1" if fail else ""}
    return subprocess.run([sys.executable, str(script), str(tmp_path / "summary.json"), "run", str(DEMO_YAML),
                           "--output", str(tmp_path / "out"), "--ds", "2026-11-30", "--run-id", "quiet", "--plain",
                           *extra], capture_output=True, text=True, timeout=120, env=env)


def _log_path(stdout: str) -> Path:
    first = stdout.splitlines()[0]
    assert first.startswith("engine logs: "), stdout
    return Path(first.removeprefix("engine logs: ").split(" (--verbose")[0])


def test_run_keeps_library_logs_off_the_terminal(tmp_path):
    r = _run(tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    terminal = r.stdout + r.stderr
    for line in LIBRARY_LINES:
        assert line not in terminal, f"{line} reached the terminal:\n{terminal}"
    assert " INFO " not in terminal and "[transformers]" not in terminal
    for line in ("run quiet: artifacts under", "shard 0: 2 rows", "progress: 2/2 rows", "shard 0: STAGE-MESSAGE",
                 "content filter: 2 rows scanned", "published 2 rows", "DOCTOR-FINDINGS"):
        assert line in r.stdout, f"{line} missing from the terminal:\n{terminal}"
    path = _log_path(r.stdout)  # the first line, before any stage's
    assert path.parent == tmp_path / "out" / "batch_llm_demo" / "runs" / "dt=2026-11-30" / "quiet" / "logs"
    log = path.read_text()
    for line in LIBRARY_LINES:
        assert line in log, f"{line} missing from {path}:\n{log}"
    assert "INFO 11-30 12:00:01 [llm.py:1] VLLM-INFO-LINE" in log and "[transformers] TRANSFORMERS-INFO-LINE" in log
    assert "] shard 0: STAGE-MESSAGE" in log  # the stages' messages too, in order with the engine's lines
    assert log.index("VLLM-INFO-LINE") < log.index("ENGINE-CORE-STDOUT") < log.index("STAGE-MESSAGE")


def test_a_terminal_gets_the_progress_bar_and_no_library_line(tmp_path):
    """On a terminal the progress bar (rich) must not take the libraries' output onto the terminal: rich's live
    display replaces ``sys.stdout``/``sys.stderr`` by default, and a logger made while it runs (vLLM's, when
    vLLM is imported by the shard) wrote over the bar and not into the log file."""
    script = tmp_path / "quiet_run.py"
    script.write_text(SCRIPT)
    rc, terminal = run_in_pty([sys.executable, str(script), str(tmp_path / "summary.json"), "run", str(DEMO_YAML),
                               "--output", str(tmp_path / "out"), "--ds", "2026-11-30", "--run-id", "quiet"],
                              timeout=120, env={**__import__("os").environ, "FAIL_SHARD": ""})
    assert rc == 0, terminal
    for line in LIBRARY_LINES:
        assert line not in terminal, f"{line} reached the terminal:\n{terminal}"
    assert "shard 0" in terminal and "2/2" in terminal and "published 2 rows" in terminal, terminal
    assert "\x1b[" in terminal  # rich drew on it: a terminal, not plain lines
    log = _log_path(terminal).read_text()
    for line in LIBRARY_LINES:
        assert line in log, f"{line} missing from the log:\n{log}"


def test_verbose_shows_everything_on_the_terminal(tmp_path):
    r = _run(tmp_path, "--verbose")
    assert r.returncode == 0, r.stdout + r.stderr
    terminal = r.stdout + r.stderr
    for line in LIBRARY_LINES + ["shard 0: STAGE-MESSAGE", "published 2 rows"]:
        assert line in terminal, f"{line} missing from the terminal:\n{terminal}"
    assert "engine logs:" not in terminal
    assert not (tmp_path / "out" / "batch_llm_demo" / "runs" / "dt=2026-11-30" / "quiet" / "logs").exists()


def test_a_failed_run_says_where_the_engine_logs_are(tmp_path):
    r = _run(tmp_path, fail=True)
    assert r.returncode == 1, r.stdout + r.stderr
    path = _log_path(r.stdout)
    assert "error: SHARD-FAILED-MESSAGE" in r.stderr and f"engine logs: {path}" in r.stderr
    assert not any(line in r.stdout + r.stderr for line in LIBRARY_LINES)
    assert "C-LEVEL-LINE" in path.read_text()


def test_verbose_flag_parses():
    assert build_parser().parse_args(["run", "p.yaml", "-v"]).verbose
    assert build_parser().parse_args(["run-shard", "p.yaml", "--shard", "0", "--verbose"]).verbose
    assert not build_parser().parse_args(["run", "p.yaml"]).verbose


@pytest.mark.parametrize("line", [
    "(EngineCore_DP0 pid=4242) INFO 11-30 12:00:02 [core.py:95] Initializing a V1 LLM engine",
    "INFO 11-30 12:00:01 [utils.py:1] non-default args: {'model': 'x'}",
    "\x1b[1;36m(EngineCore_DP0 pid=7)\x1b[0;0m \x1b[33mWARNING\x1b[0m 11-30 12:00:03 [cpu.py:1] something",
    "2026-11-30 12:00:01,123 vllm.engine starting",
    "[transformers] loading weights",
    "Processed prompts: 100%|██████████| 2/2 [00:01<00:00,  1.5it/s]",
])
def test_relayed_engine_lines_go_only_to_the_log(line):
    """A shard run in a worker process relays everything it printed, on one stream, through ``say``: library
    lines go to the log file only, the stages' messages and progress to both."""
    assert engine_line(line)
    out, log = io.StringIO(), io.StringIO()
    with Reporter(tty=False, stream=out, log=log) as rep:
        rep.say(line)
        rep.say("shard 0: engine vllm started in 3.1s")
        rep.say("progress: 1/2 rows, 5.0 output tok/s, ETA 1s")
    assert out.getvalue().splitlines() == ["shard 0: engine vllm started in 3.1s",
                                           "progress: 1/2 rows, 5.0 output tok/s, ETA 1s"]
    assert line in log.getvalue() and "] shard 0: engine vllm started in 3.1s" in log.getvalue()


def test_stage_messages_are_not_taken_for_engine_lines():
    for msg in ("run cli__x: artifacts under /o", "model m (cache hit, 270 MB) in 0.1s",
                "plan: 20 rows read, 20 valid, 0 invalid, 1 shard(s) in 0.1s", "shard 0: 20 rows",
                "progress: 10/20 rows, 35.0 output tok/s, ETA 3s", "asking again for 3 invalid outputs (attempt 2)",
                "evaluate: 0.42 (a sample of 100 of 200 rows)"):
        assert not engine_line(msg), msg


def test_a_terminal_without_rich_gets_plain_progress_lines(monkeypatch):
    """A base install has no ``rich`` (the ``cli`` extra): on a terminal the progress is plain lines, after one
    line saying which extra adds the bar, instead of an ImportError."""
    monkeypatch.setitem(sys.modules, "rich", None)  # `from rich.console import ...` raises ImportError
    monkeypatch.setitem(sys.modules, "rich.console", None)
    monkeypatch.setitem(sys.modules, "rich.progress", None)
    out = io.StringIO()
    with Reporter(tty=True, stream=out) as rep:
        rep.begin("shard 0", 2)
        rep.say("progress: 1/2 rows, 5.0 output tok/s, ETA 1s")
        rep.end()
    assert out.getvalue().splitlines() == [
        "progress as plain lines: rich is not installed here; the cli extra adds the progress bar "
        "(pip install 'batch-llm[cli]')",
        "shard 0: 2 rows", "progress: 1/2 rows, 5.0 output tok/s, ETA 1s"]
