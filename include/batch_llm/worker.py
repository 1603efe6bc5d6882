"""The engine worker: a shard run in a spawned process of its own, in its own process group.

Why a separate process: Airflow's task supervisor forks, and CUDA fails in forked processes; a fresh
interpreter (``python -m batch_llm.worker``) never inherits a CUDA context. Why its own process group: vLLM
starts engine-core processes of its own; ending the group ends them all, so a stopped task frees its GPU.

Parent side::

    handle = WorkerHandle.start(spec, python=sys.executable, env={"CUDA_VISIBLE_DEVICES": "0"})
    result = handle.wait(on_line=log.info)        # streams the worker's log lines
    handle.stop()                                 # from on_kill: SIGTERM the group, then SIGKILL

The spec (config, layout, model manifest, shard, storage options with credentials) goes over stdin, never on
the command line; the result comes back as the last ``BATCH_LLM_RESULT {json}`` line of stdout.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

from batch_llm.procgroup import (  # noqa: F401 - re-exported: worker's API before procgroup
    GroupLeader,
    live_group_members,
    process_group_alive,
    stop_process_group,
)

RESULT_PREFIX = "BATCH_LLM_RESULT "
EXIT_SHARD_FAILED = 3      # too many error rows, or an engine that cannot run the model here: no retry
EXIT_ERROR = 1


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
        super().__init__(proc)  # the group's leader, signalled only while unreaped (procgroup.GroupLeader)
        self.ipc_dir = ipc_dir
        self.tail: list[str] = []

    @classmethod
    def start(cls, spec: dict, *, python: str | None = None, env: dict | None = None) -> "WorkerHandle":
        full_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
        ipc_dir = None
        if "VLLM_RPC_BASE_PATH" not in full_env:
            ipc_dir = full_env["VLLM_RPC_BASE_PATH"] = tempfile.mkdtemp(prefix="batch_llm_ipc_")
        spec = {**spec, "spawned_at": time.time()}  # the shard's timeline starts here
        proc = subprocess.Popen([python or sys.executable, "-m", "batch_llm.worker"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=full_env,
                                start_new_session=True, text=True, bufsize=1)
        try:
            proc.stdin.write(json.dumps(spec))
            proc.stdin.close()
        except BrokenPipeError:  # the child died before reading its spec: wait() reports its exit and output
            pass
        return cls(proc, ipc_dir)

    def _remove_ipc_dir(self) -> None:
        if self.ipc_dir:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)

    def wait(self, on_line: Callable[[str], None] = print) -> dict:
        """Streams the worker's lines to ``on_line`` until it exits; returns its result or raises."""
        out = _WorkerOutput(on_line)
        lines: queue.Queue = queue.Queue()

        def pump() -> None:
            for line in self.proc.stdout:
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

    def __init__(self, on_line: Callable[[str], None]):
        self.on_line = on_line
        self.result: dict | None = None
        self.tail: list[str] = []

    def take(self, line: str) -> None:
        if line.startswith(RESULT_PREFIX):
            self.result = json.loads(line[len(RESULT_PREFIX):])
        else:
            self.tail = (self.tail + [line])[-40:]
            self.on_line(line)

    def failure(self, rc: int) -> WorkerFailed:
        reason = next((t for t in reversed(self.tail) if t.startswith("WORKER_ERROR ")), None)
        msg = reason[len("WORKER_ERROR "):] if reason else "\n".join(self.tail[-15:])
        if rc < 0:
            msg = f"worker killed by signal {-rc}; {msg}"
        return WorkerFailed(msg, rc, retryable=rc != EXIT_SHARD_FAILED)


class _FastEnd:
    """Reports a committed shard and exits at once, ending the engine's processes with SIGKILL, as a stop does.

    Once the manifest is durable, vLLM's graceful shutdown and the interpreter's teardown buy nothing; they took
    1.2–1.5 s (between the last result and the merge) and ~2.5 s (after the manifest) of every H200 shard, and
    ~2.3 s of a CPU one (docs/benchmarks.md). Used only where nothing of the engine's
    needs its own cleanup: one device (tensor parallelism shares memory segments between its processes, which
    a kill would leave behind) and this worker leading its own process group (as ``WorkerHandle`` starts it),
    so the kill reaches no one else. vLLM's socket files are left in the folder ``WorkerHandle`` made for this
    attempt, which it removes once the group is gone."""

    def __init__(self, cfg) -> None:
        self.enabled = cfg.engine.tensor_parallel_size == 1 and os.getpgrp() == os.getpid()

    def __call__(self, manifest) -> None:
        report_result(manifest)
        me = os.getpid()
        for pid in live_group_members(me):
            if pid != me:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        sys.stderr.flush()
        os._exit(0)


def report_result(manifest) -> None:
    """The one line ``WorkerHandle`` reads the shard's manifest from."""
    print(RESULT_PREFIX + manifest.model_dump_json(), flush=True)


def _die_with_parent() -> None:
    """If the task process is killed -9, the worker must not live on holding a GPU (Linux only)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def main() -> int:
    started = time.time()
    _die_with_parent()
    # On SIGTERM end the whole group, engine processes included, then exit.
    signal.signal(signal.SIGTERM, lambda *_: (os.killpg(os.getpgrp(), signal.SIGKILL)))
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(asctime)s %(name)s %(message)s")
    spec = json.loads(sys.stdin.read())
    from batch_llm.config import parse_config
    from batch_llm.engines.base import EngineCannotRun
    from batch_llm.infer import ShardFailed
    from batch_llm.stages import RunLayout, infer_shard

    cfg = parse_config(spec["config"], "worker spec")
    layout = RunLayout.from_dict(spec["layout"])
    fast_end = _FastEnd(cfg)
    try:
        result = infer_shard(cfg, layout, spec["model"], spec["shard"], say=lambda m: print(m, flush=True),
                             started={"spawned_at": spec.get("spawned_at"), "worker_started_at": started},
                             on_committed=fast_end if fast_end.enabled else None)
    except (ShardFailed, EngineCannotRun) as e:
        print(f"WORKER_ERROR {e}", flush=True)
        return EXIT_SHARD_FAILED
    except Exception as e:  # noqa: BLE001 - reported to the parent, which decides on retries
        import traceback

        traceback.print_exc(file=sys.stdout)
        print(f"WORKER_ERROR {type(e).__name__}: {e}", flush=True)
        return EXIT_ERROR
    report_result(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
