"""The stage operators' own decisions, executed outside a DAG run (no scheduler, no engine)."""
from __future__ import annotations

import datetime as dt
from types import SimpleNamespace

import pytest
from airflow.sdk.exceptions import AirflowFailException
from batch_llm_airflow.operators import FetchModelOperator
from helpers import demo_config


def _context() -> dict:
    day = dt.datetime(2026, 11, 30, tzinfo=dt.timezone.utc)
    return {"dag_run": SimpleNamespace(logical_date=day, run_after=day, clear_number=0), "run_id": "manual__t",
            "params": {}}


def test_fetch_fails_without_retry_on_a_folder_a_retry_cannot_fix(tmp_path):
    empty = tmp_path / "model"
    empty.mkdir()
    cfg = demo_config(tmp_path, model__ref=str(empty)).model_dump(mode="json")
    op = FetchModelOperator(task_id="fetch_model", pipeline_config=cfg, retries=3)
    with pytest.raises(AirflowFailException, match="the model folder lacks config.json"):
        op.execute(_context())


def test_fetch_of_a_folder_that_is_not_there_stays_retryable(tmp_path):
    """A missing path may be a mount not there yet: an ordinary error, which Airflow retries."""
    cfg = demo_config(tmp_path, model__ref=str(tmp_path / "absent")).model_dump(mode="json")
    op = FetchModelOperator(task_id="fetch_model", pipeline_config=cfg, retries=3)
    with pytest.raises(FileNotFoundError, match="no such folder"):
        op.execute(_context())


class _FakeShardRun:
    """IsolatedShard stand-in: ``run`` returns a manifest or raises what the test gives it."""

    made: list["_FakeShardRun"] = []

    def __init__(self, cfg, layout, model, shard, *, holder, outcome=None):
        self.args = (cfg, layout, model, shard, holder)
        self.lease_wait_seconds = 1.5
        self.stopped = False
        _FakeShardRun.made.append(self)

    def run_all(self, on_line, *, on_engine=None, on_warning=None):
        from batch_llm.manifests import ShardManifest

        on_line("progress: 1/1 rows, 5.0 output tok/s, ETA 0s")  # as the worker relays its lines
        on_engine("(EngineCore_DP0 pid=7) INFO 11-30 12:00:01 [core.py:1] ENGINE-START-LINE")
        on_engine("\x1b[33m(EngineCore_DP0 pid=7) WARNING 11-30 12:00:02 [cpu.py:1] ENGINE-WARNING\x1b[0m")
        on_engine("2026-11-30 12:00:03,000 WARNING py.warnings: /v/lib/python3.11/site-packages/transformers/x.py:9: "
                  "FutureWarning: LIB-WARNING")
        on_engine("  warnings.warn(")
        on_warning("PIPELINE-WARNING")
        if isinstance(self.outcome, Exception):
            raise self.outcome
        shards = self.args[3] if self.group else [self.args[3]]
        return [ShardManifest.model_validate({"shard": s["index"], "outputs": "o", "errors": "e",
                                              "metrics": {"rows": 1}, "checksum": "c"}) for s in shards]

    @property
    def group(self):
        return isinstance(self.args[3], list)

    def stop(self):
        self.stopped = True


def _inference_op(tmp_path, monkeypatch, outcome=None):
    from batch_llm_airflow import operators

    _FakeShardRun.made = []
    monkeypatch.setattr(_FakeShardRun, "outcome", outcome, raising=False)
    monkeypatch.setattr(operators, "IsolatedShard", _FakeShardRun)
    emitted = []
    monkeypatch.setattr(operators, "emit_shard_metrics", lambda *a, **k: emitted.append((a, k)))
    cfg = demo_config(tmp_path).model_dump(mode="json")
    op = operators.BatchInferenceOperator(task_id="batch_inference", pipeline_config=cfg, retries=3,
                                          shard={"index": 0, "rows": 1, "url": "file:///s"}, model={"x": 1})
    return op, emitted


def _gpu_context() -> dict:
    return {**_context(), "ti": SimpleNamespace(dag_id="d", task_id="batch_inference", map_index=0, try_number=1)}


def test_the_gpu_task_log_has_the_pipeline_and_engine_warnings_the_engine_log_the_rest(tmp_path, monkeypatch):
    """The worker's messages go to the task log; the engine's output to ``<run>/logs/<task>-<map>-try<n>.log``,
    its warnings also to the task log as warnings, one line each, named by their source."""
    op, _ = _inference_op(tmp_path, monkeypatch)
    said: list[tuple[str, str]] = []
    log = SimpleNamespace(info=lambda m, *a: said.append(("INFO", m % a)),
                          warning=lambda m, *a: said.append(("WARNING", m % a)))
    monkeypatch.setattr(type(op), "log", property(lambda self: log))  # the task log (Airflow's structlog)
    op.execute(_gpu_context())
    (run,) = _FakeShardRun.made
    path = run.args[1].run_dir.path() / "logs" / "batch_inference-0-try1.log"
    assert ("INFO", f"engine output: {run.args[1].run_dir.url}/logs/batch_inference-0-try1.log") in said
    assert ("INFO", "progress: 1/1 rows, 5.0 output tok/s, ETA 0s") in said
    assert [m for lvl, m in said if lvl == "WARNING" and "outside of the Task Runner" not in m] == [
        "vllm: ENGINE-WARNING", "transformers: FutureWarning: LIB-WARNING", "PIPELINE-WARNING"], said
    assert not any("ENGINE-START-LINE" in m or "warnings.warn(" in m for _, m in said), said
    log = path.read_text()
    assert "ENGINE-START-LINE" in log and "ENGINE-WARNING" in log and "  warnings.warn(" in log
    assert "progress:" not in log


def test_the_gpu_operator_runs_its_shard_through_the_library_and_hands_on_the_result(tmp_path, monkeypatch):
    op, emitted = _inference_op(tmp_path, monkeypatch)
    out = op.execute(_gpu_context())
    assert out["shard"] == 0 and out["metrics"]["rows"] == 1 and "checksum" not in out
    (run,) = _FakeShardRun.made
    cfg, layout, model, shard, holder = run.args
    assert (model, shard, holder) == ({"x": 1}, op.shard, "d.batch_inference")
    assert layout.run_id == "manual__t"  # the DAG run's run_id, unchanged
    assert emitted[0][1] == {"gpu_lease_wait_seconds": 1.5}
    op.on_kill()
    assert run.stopped


def test_a_gpu_task_of_several_shards_returns_each_shards_result_and_pushes_each_shards_metrics(tmp_path, monkeypatch):
    """sharding.shards_per_task: the mapped argument is a list of shards; one library call runs them all (one
    worker, one lease) and the task hands on one result per shard; the lease wait counts once."""
    op, emitted = _inference_op(tmp_path, monkeypatch)
    op.shard = [{"index": 2, "rows": 1, "url": "file:///s2"}, {"index": 3, "rows": 1, "url": "file:///s3"}]
    out = op.execute(_gpu_context())
    assert [r["shard"] for r in out] == [2, 3] and all("checksum" not in r for r in out)
    (run,) = _FakeShardRun.made
    assert run.args[3] == op.shard
    assert [e[0][1].shard for e in emitted] == [2, 3]
    assert [e[1] for e in emitted] == [{"gpu_lease_wait_seconds": 1.5}, {"gpu_lease_wait_seconds": 0.0}]


def test_the_gpu_operator_fails_without_retry_only_when_the_library_says_so(tmp_path, monkeypatch):
    from batch_llm.isolation.shard_process import ShardFailedNoRetry, ShardWorkerFailed

    op, _ = _inference_op(tmp_path, monkeypatch, ShardFailedNoRetry("too many error rows", 3))
    with pytest.raises(AirflowFailException, match="too many error rows"):
        op.execute(_gpu_context())
    op, _ = _inference_op(tmp_path, monkeypatch, ShardWorkerFailed("shard 0 worker failed (exit -9): x", -9))
    with pytest.raises(ShardWorkerFailed):
        op.execute(_gpu_context())


def test_the_gpu_operator_is_thin():
    """The operator's execute is one library call (resolve, run, metrics, result)."""
    import inspect

    from batch_llm_airflow.operators import BatchInferenceOperator

    src = inspect.getsource(BatchInferenceOperator.execute.__wrapped__)
    assert len(src.strip().splitlines()) <= 15, src


def test_every_operator_builds_the_layout_as_the_library_does_with_the_run_id_unchanged(tmp_path):
    """One way to build a run's layout: the operators' resolve is RunLayout.for_run with the
    locations their storage hook resolved; a cleared run (clear_number 2) keeps the DAG run's run_id."""
    from batch_llm.layout import RunLayout

    cfg = demo_config(tmp_path)
    ctx = _context()
    ctx["dag_run"].clear_number = 2
    op = FetchModelOperator(task_id="fetch_model", pipeline_config=cfg.model_dump(mode="json"))
    resolved, layout = op.resolve(ctx)
    expected = RunLayout.for_run(resolved, run_id="manual__t", ds="2026-11-30")
    assert (layout.run_dir.url, layout.input.url, layout.partition) == \
        (expected.run_dir.url, expected.input.url, expected.partition)
    assert layout.run_id == "manual__t" and layout.run_dir.url.endswith("/manual__t")


def test_publish_hands_on_a_typed_reference_with_what_steps_after_it_read():
    """XCom of publish: PublishedRef (dataset for custom steps, report for the Run report link), not the manifest."""
    from batch_llm.manifests import PublishedRef, PublishManifest

    m = PublishManifest(partition="dt=2026-11-30", version="v1", dataset="/o/data.jsonl", rows=2, summary="/o/s.json",
                        errors="/o/e.jsonl", error_rows=0, report="/o/report.html", seconds=3.0)
    ref = m.ref()
    assert isinstance(ref, PublishedRef)
    assert ref.model_dump(mode="json") == m.model_dump(include={"partition", "dataset", "rows", "summary", "errors",
                                                                "report", "table"})


def test_for_run_takes_locations_already_resolved(tmp_path):
    """The operators hand RunLayout.for_run the Locations of their storage hook (with the connection's options)."""
    from batch_llm.io.storage import Location
    from batch_llm.layout import RunLayout

    cfg = demo_config(tmp_path)
    out, inp = Location(str(tmp_path / "o"), {"key": "k"}), Location(str(tmp_path / "in.jsonl"), {"key": "i"})
    layout = RunLayout.for_run(cfg, run_id="r", ds="2026-11-30", output_location=out, input_location=inp)
    assert layout.output_root is out and layout.input is inp
    assert layout.partition == cfg.output.partition.format(ds="2026-11-30")


def test_a_task_validates_its_pipeline_config_once(monkeypatch):
    """In a task's process the DAG file's parse validates the pipeline's config; the operator takes that config
    (its argument, the JSON dump the DAG carries, keeps it) and the run's Params validate again only where they
    change it. The worker is sent the dump and validates it once, in its own process."""
    from batch_llm.config import PipelineConfig, load_config
    from batch_llm.isolation.shard_process import worker_spec
    from batch_llm_airflow.dag_factory import pipeline_dag
    from batch_llm_airflow.params import params_for
    from helpers import DEMO_YAML

    validated = []
    validate = PipelineConfig.model_validate
    monkeypatch.setattr(PipelineConfig, "model_validate",
                        classmethod(lambda cls, data, **kw: validated.append(data) or validate(data, **kw)))
    cfg = load_config(DEMO_YAML)
    plan = pipeline_dag(cfg, source="demo.yaml (test)").get_task("pipeline.plan_shards")
    form = {k: p.value for k, p in params_for(cfg).items()}  # the trigger form, left as the YAML has it
    assert len(validated) == 1  # the YAML, at the DAG file's parse
    for _ in range(2):
        got, layout = plan.resolve({**_context(), "params": form})
        assert got is cfg and len(validated) == 1
    changed, _ = plan.resolve({**_context(), "params": {**form, "temperature": 0.7}})
    assert changed.sampling.temperature == 0.7 and len(validated) == 2
    spec = worker_spec(got, layout, {"local_dir": "/m"}, {"index": 0, "rows": 1, "url": "file:///s"})
    assert spec["config"] == cfg.model_dump(mode="json") and len(validated) == 2
