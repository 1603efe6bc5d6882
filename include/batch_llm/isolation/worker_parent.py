"""The engine worker: a shard run in a spawned process of its own, in its own process group.

Why a separate process: Airflow's task supervisor forks, and CUDA fails in forked processes; a fresh
interpreter (``python -m batch_llm.isolation.worker_child``) never inherits a CUDA context. Why its own process group: vLLM
starts engine-core processes of its own; ending the group ends them all, so a stopped task frees its GPU.

Parent side::

    handle = WorkerHandle.start(spec, python=sys.executable, env={"CUDA_VISIBLE_DEVICES": "0"})
    result = handle.wait(on_line=log.info)        # streams the worker's log lines
    handle.stop()                                 # from on_kill: SIGTERM the group, then SIGKILL

The spec (config, layout, model manifest, shard, storage options with credentials) goes over stdin, never on
the command line; the result comes back as the last ``BATCH_LLM_RESULT {json}`` line of stdout.

This module is the parent's side (``WorkerHandle``); the child's, the shard run and its fast end, is
``batch_llm.isolation.worker_child``, which ``WorkerHandle.start`` runs as ``python -m batch_llm.isolation.worker_child``.
"""
from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import IO

from batch_llm.host.procgroup import GroupLeader
from batch_llm.isolation.worker_child import EXIT_SHARD_FAILED, RESULT_PREFIX, SAY_PREFIX, WARN_PREFIX


class WorkerFailed(RuntimeError):
    def __init__(self, message: str, returncode: int, retryable: bool = True):
        super().__init__(message)
        self.returncode = returncode
        self.retryable = retryable


class WorkerHandle(GroupLeader):
    """A worker process in a session (process group) of its own, and the folder vLLM puts its sockets in.

    vLLM's ``ipc://`` socket files go to ``VLLM_RPC_BASE_PATH``; a worker that ends with SIGKILL (its fast end, a
    stop, a crash) leaves them behind. The handle outlives every such end, so it owns that folder: one per attempt,
    made here unless the caller chose one, removed once the worker's group is gone."""

    def __init__(self, proc: subprocess.Popen, ipc_dir: str | None = None):
        if proc.stdout is None:  # wait() streams the worker's lines and reads its result from there
            raise ValueError("WorkerHandle needs the worker's stdout as a pipe (stdout=subprocess.PIPE)")
        super().__init__(proc)  # the group's leader, signalled only while unreaped (procgroup.GroupLeader)
        self.stdout: IO[str] = proc.stdout
        self.ipc_dir = ipc_dir
        self.tail: list[str] = []

    @classmethod
    def start(cls, spec: dict, *, python: str | None = None, env: dict | None = None) -> "WorkerHandle":
        full_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
        ipc_dir = None
        if "VLLM_RPC_BASE_PATH" not in full_env:
            ipc_dir = full_env["VLLM_RPC_BASE_PATH"] = tempfile.mkdtemp(prefix="batch_llm_ipc_")
        spec = {**spec, "spawned_at": time.time()}  # the shard's timeline starts here
        proc = subprocess.Popen([python or sys.executable, "-m", "batch_llm.isolation.worker_child"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=full_env,
                                start_new_session=True, text=True, bufsize=1)
        assert proc.stdin is not None  # stdin=PIPE above: Popen always opens it
        try:
            proc.stdin.write(json.dumps(spec))
            proc.stdin.close()
        except BrokenPipeError:  # the child died before reading its spec: wait() reports its exit and output
            pass
        return cls(proc, ipc_dir)

    def _remove_ipc_dir(self) -> None:
        if self.ipc_dir:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)

    def wait(self, on_line: Callable[[str], None] = print, *, on_engine: Callable[[str], None] | None = None,
             on_warning: Callable[[str], None] | None = None) -> dict:
        """Streams the worker's lines until it exits; returns its result or raises. Its own messages go to
        ``on_line`` (its warnings to ``on_warning``), the engine's output to ``on_engine``; each None: ``on_line``."""
        out = _WorkerOutput(on_line, on_engine, on_warning)
        lines: queue.Queue = queue.Queue()

        def pump() -> None:
            for line in self.stdout:
                lines.put(line.rstrip("\n"))
            lines.put(None)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        # Not "read until EOF": an engine process orphaned by a worker killed with SIGKILL still holds the
        # pipe open. Watch the worker itself, then end its group (which closes the pipe) and drain.
        while True:
            try:
                line = lines.get(timeout=0.5)
            except queue.Empty:
                if self._leader_exited():
                    break
                continue
            if line is None:
                break
            out.take(line)
        self._wait_leader_exit()
        # Engine processes (vLLM's engine core) outlive a worker that died by SIGKILL and keep the GPU's
        # memory; they share the worker's process group, so end the group whatever the exit was.
        self._end_group(grace_seconds=10)
        rc = self.proc.wait()
        self._remove_ipc_dir()
        reader.join(timeout=10)
        while not lines.empty():
            line = lines.get_nowait()
            if line is not None:
                out.take(line)
        self.tail = out.tail
        if rc == 0 and out.result is not None:
            return out.result
        raise out.failure(rc)

    def stop(self, grace_seconds: float = 10.0) -> None:
        """Ends the worker's whole process group (engine processes included) and waits for it."""
        self._end_group(grace_seconds)
        self._remove_ipc_dir()


class _WorkerOutput:
    """What the parent keeps of a worker's stdout: the result line, and the last lines for an error message."""

    def __init__(self, on_line: Callable[[str], None], on_engine: Callable[[str], None] | None = None,
                 on_warning: Callable[[str], None] | None = None):
        self.on_line = on_line
        self.on_engine = on_engine or on_line
        self.on_warning = on_warning or on_line
        self.result: dict | None = None
        self.tail: list[str] = []

    def take(self, line: str) -> None:
        if line.startswith(RESULT_PREFIX):
            self.result = json.loads(line[len(RESULT_PREFIX):])
            return
        if line.startswith(SAY_PREFIX):
            line, to = line[len(SAY_PREFIX):], self.on_line
        elif line.startswith(WARN_PREFIX):
            line, to = line[len(WARN_PREFIX):], self.on_warning
        elif line.startswith("WORKER_ERROR "):
            to = self.on_line
        else:
            to = self.on_engine
        self.tail = (self.tail + [line])[-40:]
        to(line)

    def failure(self, rc: int) -> WorkerFailed:
        reason = next((t for t in reversed(self.tail) if t.startswith("WORKER_ERROR ")), None)
        msg = reason[len("WORKER_ERROR "):] if reason else "\n".join(self.tail[-15:])
        if rc < 0:
            msg = f"worker killed by signal {-rc}; {msg}"
        return WorkerFailed(msg, rc, retryable=rc != EXIT_SHARD_FAILED)
