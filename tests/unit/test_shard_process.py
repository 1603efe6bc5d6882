"""run_shard_isolated / IsolatedShard: lease → spawn → record → wait → release, in that order, whatever the end
(GpuLease and WorkerHandle replaced by recorders: no worker process, no GPU)."""
from __future__ import annotations

import pytest
from batch_llm.isolation import shard_process
from batch_llm.isolation.shard_process import IsolatedShard, ShardFailedNoRetry, ShardWorkerFailed, run_shard_isolated
from batch_llm.isolation.worker_parent import WorkerFailed
from batch_llm.layout import RunLayout
from helpers import demo_config

MANIFEST = {"stage": "infer", "shard": 3, "outputs": "o.jsonl", "errors": "e.jsonl", "metrics": {"rows": 2},
            "checksum": "x"}
SHARD = {"index": 3, "rows": 2, "url": "file:///shard-00003.jsonl"}
MODEL = {"local_dir": "/models/m", "model_key": "m@1#abc"}


class Recorder:
    """GpuLease and WorkerHandle stand-ins writing one event list; ``wait`` does what the test asks."""

    def __init__(self, monkeypatch, *, gpus: list[str], wait=None):
        self.events: list[tuple] = []
        self.on_wait = wait or (lambda: MANIFEST)
        rec = self

        class Lease:
            cuda_visible_devices = ",".join(gpus[:1])

            @classmethod
            def acquire(cls, count, *, gpus, holder, poll):
                rec.events.append(("acquire", count, tuple(gpus), holder))
                return cls()

            def record_worker(self, pgid):
                rec.events.append(("record_worker", pgid))

            def release(self):
                rec.events.append(("release",))

        class Handle:
            pid = 4242

            @classmethod
            def start(cls, spec, *, python, env):
                rec.events.append(("start", spec["shard"], spec["model"], env))
                return cls()

            def wait(self, on_line, **_):
                rec.events.append(("wait",))
                on_line("worker says hello")
                return rec.on_wait()

            def stop(self):
                rec.events.append(("stop",))

        monkeypatch.setattr(shard_process, "visible_gpus", lambda: list(gpus))
        monkeypatch.setattr(shard_process, "GpuLease", Lease)
        monkeypatch.setattr(shard_process, "WorkerHandle", Handle)

    @property
    def names(self) -> list[str]:
        return [e[0] for e in self.events]


def _run_args(tmp_path):
    cfg = demo_config(tmp_path)
    return cfg, RunLayout.for_run(cfg, run_id="manual__t", ds="2026-11-30"), MODEL, SHARD


def test_a_gpu_worker_leases_spawns_pinned_records_waits_and_releases_in_that_order(tmp_path, monkeypatch):
    rec = Recorder(monkeypatch, gpus=["0", "1"])
    lines: list[str] = []
    m = run_shard_isolated(*_run_args(tmp_path), holder="dag.batch_inference", on_line=lines.append)
    assert m.shard == 3 and m.metrics.rows == 2
    assert rec.names == ["acquire", "start", "record_worker", "wait", "release"]
    assert rec.events[0] == ("acquire", 1, ("0", "1"), "dag.batch_inference")
    assert rec.events[1] == ("start", SHARD, MODEL, {"CUDA_VISIBLE_DEVICES": "0"})  # XCom values as they came
    assert rec.events[2] == ("record_worker", 4242)
    assert lines[0].startswith("leased GPU(s) 0 after ")
    assert lines[1:] == ["shard 3 (2 rows): worker pid 4242", "worker says hello"]


def test_without_visible_gpus_nothing_is_leased_and_the_worker_gets_no_pinning(tmp_path, monkeypatch):
    rec = Recorder(monkeypatch, gpus=[])
    run = IsolatedShard(*_run_args(tmp_path), holder="h")
    run.run(on_line=lambda _: None)
    assert rec.names == ["start", "wait"]
    assert rec.events[0][3] == {}
    assert run.gpus is None and run.lease_wait_seconds == 0.0


def _fail(retryable: bool):
    def wait():
        raise WorkerFailed("too many error rows", 3 if not retryable else -9, retryable=retryable)
    return wait


def test_a_failure_a_retry_cannot_fix_is_its_own_type_and_the_lease_is_released(tmp_path, monkeypatch):
    rec = Recorder(monkeypatch, gpus=["0"], wait=_fail(retryable=False))
    with pytest.raises(ShardFailedNoRetry, match="^too many error rows$") as e:
        run_shard_isolated(*_run_args(tmp_path), holder="h", on_line=lambda _: None)
    assert e.value.returncode == 3
    assert rec.names[-1] == "release"


def test_any_other_failure_is_a_retryable_runtime_error_naming_the_shard_and_exit(tmp_path, monkeypatch):
    rec = Recorder(monkeypatch, gpus=["0"], wait=_fail(retryable=True))
    with pytest.raises(ShardWorkerFailed, match=r"^shard 3 worker failed \(exit -9\): too many error rows$") as e:
        run_shard_isolated(*_run_args(tmp_path), holder="h", on_line=lambda _: None)
    assert isinstance(e.value, RuntimeError) and not isinstance(e.value, ShardFailedNoRetry)
    assert rec.names[-1] == "release"


def test_stop_ends_the_worker_group_before_the_lease_is_released_and_releases_once(tmp_path, monkeypatch):
    """on_kill arrives while ``run`` waits (Airflow's SIGTERM handler, in the task's thread): the group first,
    then the GPUs; ``run``'s own release afterwards gives nothing back twice."""
    runs: list[IsolatedShard] = []

    def killed_while_waiting():
        runs[0].stop()
        raise WorkerFailed("killed", -15)

    rec = Recorder(monkeypatch, gpus=["0"], wait=killed_while_waiting)
    lines: list[str] = []
    runs.append(IsolatedShard(*_run_args(tmp_path), holder="h"))
    with pytest.raises(ShardWorkerFailed):
        runs[0].run(on_line=lines.append)
    assert rec.names == ["acquire", "start", "record_worker", "wait", "stop", "release"]
    assert any(x.startswith("worker process group 4242 ended in ") for x in lines)


def test_stop_before_the_worker_started_only_releases_what_is_held(tmp_path, monkeypatch):
    rec = Recorder(monkeypatch, gpus=["0"])
    IsolatedShard(*_run_args(tmp_path), holder="h").stop()
    assert rec.events == []
