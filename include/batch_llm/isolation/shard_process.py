"""One shard run in a worker process of its own, on GPUs leased for it: the GPU operator's one library call.

The Airflow operator, the benchmarks (``bench/gpu_checks.py``) and anything else that runs a shard isolated go
through here, so the sequence is written once::

    lease GPUs (only where GPUs are visible) → spawn the worker pinned to them (CUDA_VISIBLE_DEVICES)
    → record the worker's process group in the lease → wait for its manifest → release the lease

    shard = IsolatedShard(cfg, layout, model, spec, holder="dag.task")
    manifest = shard.run(on_line=log.info)     # blocks; streams the worker's log lines
    shard.stop()                               # from another thread or a signal handler (on_kill)

A list of shards (a task of ``sharding.shards_per_task`` consecutive shards) runs in one worker on one engine,
in turn, each shard committed as it would be alone: ``run_all`` returns their manifests (``run`` the first's).

``run_shard_isolated(...)`` is the same for a caller that does not need to stop it. A worker that fails so that
a retry would fail the same way (too many error rows, an engine that cannot run the model here) raises
``ShardFailedNoRetry``; any other failure ``ShardWorkerFailed`` (a ``RuntimeError``: retry it). No Airflow here.
"""
from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from batch_llm.config import PipelineConfig
from batch_llm.host.gpus import visible_gpus
from batch_llm.isolation.gpu_lease import GpuLease
from batch_llm.isolation.worker_parent import WorkerFailed, WorkerHandle
from batch_llm.layout import RunLayout
from batch_llm.manifests import ModelRef, ShardManifest, ShardSpec


class ShardFailedNoRetry(RuntimeError):
    """The worker failed in a way a retry cannot fix (it exited with ``EXIT_SHARD_FAILED``)."""

    def __init__(self, message: str, returncode: int):
        super().__init__(message)
        self.returncode = returncode


class ShardWorkerFailed(RuntimeError):
    """The worker failed in a way a retry may fix (a crash, a kill, an error of the moment)."""

    def __init__(self, message: str, returncode: int):
        super().__init__(message)
        self.returncode = returncode


def _json(x: Any) -> Any:
    return x.model_dump(mode="json") if isinstance(x, BaseModel) else x


def worker_spec(cfg: PipelineConfig, layout: RunLayout, model: ModelRef | dict,
                shard: ShardSpec | dict | list[ShardSpec | dict], stage: str = "infer") -> dict:
    """What ``python -m batch_llm.isolation.worker_child`` reads from stdin: config, layout, model reference, shard (or
    ``shards``: a task's shards, run in turn on one engine) and the run's folder they commit in (``stage``: infer,
    or review for the content review's pass)."""
    spec = {"config": cfg.model_dump(mode="json"), "layout": layout.to_dict(), "model": _json(model), "stage": stage}
    if isinstance(shard, list):
        return {**spec, "shards": [_json(s) for s in shard]}
    return {**spec, "shard": _json(shard)}


class IsolatedShard:
    """A shard run in a spawned worker: owns the ``GpuLease`` and the ``WorkerHandle`` while it runs.

    ``run`` releases the lease whatever the outcome; ``stop`` (on_kill) ends the worker's whole process group,
    waits until it is gone, then releases the lease, so the GPU is free when it returns."""

    def __init__(self, cfg: PipelineConfig, layout: RunLayout, model: ModelRef | dict,
                 shard: ShardSpec | dict | list[ShardSpec | dict], *,
                 holder: str, python: str | None = None, lease_poll: float = 2.0, stage: str = "infer"):
        self.cfg, self.layout, self.model, self.holder = cfg, layout, model, holder
        self.stage = stage  # the run's folder the shards commit in: infer, or review (stages.review)
        self.group = isinstance(shard, list)  # a task's shards, run in turn on one engine
        self._shard_json: Any = [_json(s) for s in shard] if isinstance(shard, list) else _json(shard)
        self.shards = [ShardSpec.model_validate(s) for s in (self._shard_json if self.group else [self._shard_json])]
        if not self.shards:
            raise ValueError("no shard to run")
        self.shard = self.shards[0]
        self.python = python or cfg.engine.python or sys.executable
        self.lease_poll = lease_poll
        self.lease: GpuLease | None = None
        self.worker: WorkerHandle | None = None
        self.lease_wait_seconds = 0.0
        self.gpus: str | None = None           # the GPUs leased (CUDA_VISIBLE_DEVICES), kept after the release
        self._say: Callable[[str], None] = print

    def _lease(self) -> dict:
        """Leases ``tensor_parallel_size`` GPUs where the machine has any; the worker's environment for them."""
        gpus = visible_gpus()
        if not gpus:
            return {}
        t0 = time.monotonic()
        self.lease = GpuLease.acquire(self.cfg.engine.tensor_parallel_size, gpus=gpus, holder=self.holder,
                                      poll=self.lease_poll)
        self.lease_wait_seconds = time.monotonic() - t0
        self.gpus = self.lease.cuda_visible_devices
        self._say(f"leased GPU(s) {self.gpus} after {self.lease_wait_seconds:.1f}s")
        return {"CUDA_VISIBLE_DEVICES": self.gpus}

    def run(self, on_line: Callable[[str], None] = print) -> ShardManifest:
        """Leases, spawns, records the worker in the lease, waits for its manifest; releases the lease."""
        return self.run_all(on_line)[0]

    def run_all(self, on_line: Callable[[str], None] = print, *, on_engine: Callable[[str], None] | None = None,
                on_warning: Callable[[str], None] | None = None) -> list[ShardManifest]:
        """``run`` for every shard given: their manifests, in order (one for a single shard). The worker's messages
        go to ``on_line`` (warnings: ``on_warning``), the engine's output to ``on_engine`` (``WorkerHandle.wait``)."""
        self._say = on_line
        try:
            env = self._lease()
            spec = worker_spec(self.cfg, self.layout, self.model, self._shard_json, stage=self.stage)
            self.worker = WorkerHandle.start(spec, python=self.python, env=env)
            if self.lease is not None:
                self.lease.record_worker(self.worker.pid)
            what = ", ".join(f"shard {s.index} ({s.rows} rows)" for s in self.shards)
            on_line(f"{what}: worker pid {self.worker.pid}")
            try:
                result = self.worker.wait(on_line=on_line, on_engine=on_engine, on_warning=on_warning)
                if self.group:
                    return [ShardManifest.model_validate(m) for m in result["shards"]]
                return [ShardManifest.model_validate(result)]
            except WorkerFailed as e:
                if not e.retryable:
                    raise ShardFailedNoRetry(str(e), e.returncode) from None
                name = f"shard {self.shard.index}" if not self.group else \
                    "shards " + ",".join(str(s.index) for s in self.shards)
                raise ShardWorkerFailed(f"{name} worker failed (exit {e.returncode}): {e}",
                                        e.returncode) from None
        finally:
            self.release()

    def stop(self) -> None:
        """Ends the worker's process group (engine processes included) and waits for it; releases the lease."""
        t0 = time.monotonic()
        if self.worker is not None:
            self.worker.stop()
            self._say(f"worker process group {self.worker.pid} ended in {time.monotonic() - t0:.1f}s")
        self.release()

    def release(self) -> None:
        """Gives the GPUs back (once: ``run``'s end and ``stop`` may both get here)."""
        lease, self.lease = self.lease, None
        if lease is not None:
            lease.release()


def run_shard_isolated(cfg: PipelineConfig, layout: RunLayout, model: ModelRef | dict, shard: ShardSpec | dict, *,
                       holder: str, on_line: Callable[[str], None] = print, python: str | None = None,
                       lease_poll: float = 2.0) -> ShardManifest:
    """Runs one shard in a worker process of its own, on GPUs leased for it (see ``IsolatedShard``)."""
    return IsolatedShard(cfg, layout, model, shard, holder=holder, python=python, lease_poll=lease_poll).run(on_line)
