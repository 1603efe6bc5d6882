"""``WorkerHandle`` signals the worker's process group only while the leader is unreaped.

The group is named by the leader's pid; once the leader is reaped, that pid (and so that group id) may be
handed to an unrelated process, which a late ``killpg`` would then hit. A zombie leader still holds its pid,
so the handle signals first and reaps after, and never signals a group whose leader it has reaped.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
from batch_llm.host.procgroup import process_group_alive
from batch_llm.isolation.worker_child import RESULT_PREFIX
from batch_llm.isolation.worker_parent import WorkerFailed, WorkerHandle


def _own_session(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1)


def _spy_killpg(monkeypatch, handle: WorkerHandle) -> list:
    """Records, for each killpg of the handle's group, whether the leader had been reaped by then."""
    calls = []
    real = os.killpg

    def spy(pgid: int, sig: int) -> None:
        if pgid == handle.pid and sig != 0:  # signal 0 only asks whether the group exists
            calls.append((sig, handle.proc.returncode is not None))
        real(pgid, sig)

    monkeypatch.setattr(os, "killpg", spy)
    return calls


def test_stop_does_not_signal_the_group_of_a_reaped_leader(monkeypatch):
    handle = WorkerHandle(_own_session("pass"))
    handle.proc.wait()  # reaped: its pid may now be anyone's
    calls = _spy_killpg(monkeypatch, handle)
    handle.stop(grace_seconds=1)
    assert calls == []


def test_wait_ends_the_orphans_before_it_reaps_the_worker(monkeypatch):
    """The worker exits leaving an engine-like child in its group (holding stdout open): the group is ended
    while the exited leader is still a zombie holding the group's id, and only then reaped."""
    code = textwrap.dedent(f"""
        import subprocess, sys
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print("CHILD", child.pid, flush=True)
        print({RESULT_PREFIX!r} + '{{"ok": 1}}', flush=True)
    """)
    handle = WorkerHandle(_own_session(code))
    calls = _spy_killpg(monkeypatch, handle)
    lines: list[str] = []
    t0 = time.monotonic()
    assert handle.wait(on_line=lines.append) == {"ok": 1}
    assert time.monotonic() - t0 < 20 and handle.proc.returncode == 0
    assert lines[0].startswith("CHILD") and not process_group_alive(handle.pid)  # the orphan is gone
    assert calls and not any(reaped for _, reaped in calls), calls


def test_stop_during_wait_ends_the_group_once_and_reaps_after(monkeypatch):
    """on_kill (Airflow's SIGTERM handler) stops a running worker: signals go to the live group; the reap
    comes after them, and wait() then reports the killed worker without signalling again."""
    import threading

    handle = WorkerHandle(_own_session("import time; print('up', flush=True); time.sleep(600)"))
    calls = _spy_killpg(monkeypatch, handle)
    assert handle.proc.stdout.readline().strip() == "up"
    stopper = threading.Timer(0.5, handle.stop, kwargs={"grace_seconds": 5})
    stopper.start()
    try:
        handle.wait(on_line=lambda _: None)
    except WorkerFailed as e:
        assert e.returncode < 0
    stopper.join()
    assert calls and not any(reaped for _, reaped in calls), calls
    assert not process_group_alive(handle.pid)


def test_a_handle_needs_the_workers_output_as_a_pipe():
    """wait() reads the worker's lines and result from its stdout: a process without that pipe is refused at
    once, not left to a reader thread that fails while wait() waits on."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    try:
        with pytest.raises(ValueError, match="stdout"):
            WorkerHandle(proc)
    finally:
        proc.wait()
