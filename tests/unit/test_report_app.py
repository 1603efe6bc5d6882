"""The report app of the API server: its roots come from the pipeline YAMLs without running pipeline code, and
an ``s3://`` report is read with its root's own connection only."""
from __future__ import annotations

import sys
import textwrap
from types import SimpleNamespace

import pytest
from batch_llm_airflow import report_app
from batch_llm_airflow.report_app import ReportError, Root

SPY = "batch_llm_spy_output_schema"


def _pipeline_with_python_schema(tmp_path, monkeypatch):
    """A pipeline whose output schema is a pydantic model (``module:Class``); importing that module leaves a
    mark on disk, so an import in any process shows."""
    code = tmp_path / "code"
    code.mkdir()
    mark = tmp_path / "imported.mark"
    (code / f"{SPY}.py").write_text(textwrap.dedent(f"""
        from pathlib import Path
        from pydantic import BaseModel

        Path({str(mark)!r}).write_text("imported")

        class Out(BaseModel):
            answer: str
    """))
    monkeypatch.syspath_prepend(str(code))
    monkeypatch.delitem(sys.modules, SPY, raising=False)
    pipelines = tmp_path / "pipelines"
    pipelines.mkdir()
    (pipelines / "spy.yaml").write_text(textwrap.dedent(f"""
        name: spy_pipe
        model: {{ref: owner/model}}
        input: {{path: {tmp_path / 'in'}}}
        output: {{path: ./../out}}
        sampling: {{output_schema: "{SPY}:Out"}}
    """))
    monkeypatch.setenv("BATCH_LLM_PIPELINES_DIR", str(pipelines))
    monkeypatch.delenv(report_app.ROOTS_ENV, raising=False)
    return mark


def test_roots_come_from_the_yaml_without_importing_pipeline_code(tmp_path, monkeypatch):
    mark = _pipeline_with_python_schema(tmp_path, monkeypatch)
    report = tmp_path / "out" / "spy_pipe" / "dt=2026-01-01" / "v-1" / "report.html"
    report.parent.mkdir(parents=True)
    report.write_text("<p>the report</p>")
    monkeypatch.setattr(report_app, "ROOTS_TTL_SECONDS", -1.0)  # every call re-reads the roots
    monkeypatch.setattr(report_app, "can_read_dag", lambda user, dag_id: dag_id == "spy_pipe")

    roots = report_app.configured_roots()
    assert roots == [Root(str(tmp_path / "out" / "spy_pipe"), None, "spy_pipe", "spy.yaml")]
    assert report_app.read_report(str(report), None, user=object()) == b"<p>the report</p>"
    assert [r["dag_id"] for r in report_app.recent_reports(object())] == ["spy_pipe"]
    assert not mark.exists() and SPY not in sys.modules, "the API server imported a pipeline author's module"


def test_a_yaml_without_name_or_output_gives_no_root(tmp_path, monkeypatch):
    _pipeline_with_python_schema(tmp_path, monkeypatch)
    pipelines = tmp_path / "pipelines"
    (pipelines / "a_nameless.yaml").write_text("output: {path: /data}\n")
    (pipelines / "b_broken.yaml").write_text("name: [unclosed\n")
    (pipelines / "c_no_output.yaml").write_text("name: x\n")
    assert [r.dag_id for r in report_app.configured_roots()] == ["spy_pipe"]


class _FakeHook:
    """BatchLlmStorageHook's stand-in: records the connection a report is read with."""
    used: list = []

    def __init__(self, conn_id):
        self.conn_id = conn_id

    def location(self, url):
        _FakeHook.used.append(self.conn_id)
        fake = SimpleNamespace(fs=SimpleNamespace(size=lambda p: 5), path="p", read_bytes=lambda: b"bytes")
        return SimpleNamespace(path=lambda: fake)


@pytest.fixture
def s3_roots(monkeypatch):
    import batch_llm_airflow.hooks

    _FakeHook.used = []
    monkeypatch.setattr(batch_llm_airflow.hooks, "BatchLlmStorageHook", _FakeHook)
    monkeypatch.setattr(report_app, "can_read_dag", lambda user, dag_id: True)
    roots = [Root("s3://lake/pipes", "lake_conn", "with_conn", "a.yaml"), Root("s3://open/reports", None, None, "env")]
    monkeypatch.setattr(report_app, "allowed_roots", lambda: roots)


def test_a_root_without_a_connection_does_not_take_the_callers(s3_roots):
    url = "s3://open/reports/some_dag/dt=1/v-1/report.html"
    with pytest.raises(ReportError) as e:
        report_app.read_report(url, "someone_elses_conn", user=object())
    assert e.value.status == 403 and _FakeHook.used == []
    assert report_app.read_report(url, None, user=object()) == b"bytes"
    assert _FakeHook.used == [None]  # the root's own (none: the server's default credentials)


def test_a_root_with_a_connection_uses_it_and_only_it(s3_roots):
    url = "s3://lake/pipes/dt=1/v-1/report.html"
    assert report_app.read_report(url, None, user=object()) == b"bytes"
    assert report_app.read_report(url, "lake_conn", user=object()) == b"bytes"
    with pytest.raises(ReportError, match="not the one configured"):
        report_app.read_report(url, "other_conn", user=object())
    assert _FakeHook.used == ["lake_conn", "lake_conn"]
