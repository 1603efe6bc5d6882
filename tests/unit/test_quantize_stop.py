"""Stopping the quantize exporter ends its whole process group before it reaps the exporter.

The exporter runs in a process group of its own (``start_new_session``), named by its pid; a killed task stops
it with ``quantize.stop_exporter``. Once the exporter is reaped its pid, and so that group id, may be handed to someone
else, so the group is signalled only while the exporter is unreaped (a zombie still holds its pid), and it is
reaped only once no live member of its group is left: a child that outlives the exporter (slow to exit, or
ignoring SIGTERM) is waited for, then killed, not left running.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
from batch_llm.host.procgroup import live_group_members
from batch_llm.stages import quantize


def _exporter_with_child(child_on_sigterm: str) -> tuple[subprocess.Popen, int]:
    """An exporter stand-in in a session of its own with one child in its group, both up and running; the
    child's SIGTERM handler is ``child_on_sigterm``. Returns the exporter and the child's pid."""
    child = textwrap.dedent(f"""
        import signal, sys, time
        signal.signal(signal.SIGTERM, {child_on_sigterm})
        print("READY", flush=True)
        time.sleep(600)
    """)
    code = textwrap.dedent(f"""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", {child!r}])
        print("CHILD", child.pid, flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, text=True, start_new_session=True)
    lines = [proc.stdout.readline().split() for _ in range(2)]
    assert sorted(line[0] for line in lines) == ["CHILD", "READY"], lines
    return proc, next(int(line[1]) for line in lines if line[0] == "CHILD")


def _spy_killpg(monkeypatch, proc: subprocess.Popen) -> list:
    """Records, for each signal sent to the exporter's group, whether the exporter had been reaped by then."""
    calls = []
    real = os.killpg

    def spy(pgid: int, sig: int) -> None:
        if pgid == proc.pid and sig != 0:  # signal 0 only asks whether the group exists
            calls.append((sig, proc.returncode is not None))
        real(pgid, sig)

    monkeypatch.setattr(os, "killpg", spy)
    return calls


def _cleanup(proc: subprocess.Popen, child: int) -> None:
    if child in live_group_members(proc.pid):  # still in the group: its pid is still its own
        os.kill(child, signal.SIGKILL)
    if proc.returncode is None:
        proc.kill()
        proc.wait()
    proc.stdout.close()


@pytest.mark.parametrize("child_on_sigterm, grace", [
    ("lambda *_: (time.sleep(0.5), sys.exit(0))", 10.0),  # slow to exit: waited for
    ("signal.SIG_IGN", 1.0),                               # ignores SIGTERM: killed after the grace
])
def test_stop_ends_the_group_before_it_reaps_the_exporter(monkeypatch, child_on_sigterm, grace):
    monkeypatch.setattr(quantize, "STOP_GRACE_SECONDS", grace)
    proc, child = _exporter_with_child(child_on_sigterm)
    try:
        calls = _spy_killpg(monkeypatch, proc)
        quantize.stop_exporter(proc)
        assert live_group_members(proc.pid) == [], "a member of the exporter's group outlived the stop"
        assert proc.returncode == -signal.SIGTERM  # reaped, after the group was gone
        assert calls and calls[0] == (signal.SIGTERM, False), calls
        assert not any(reaped for _, reaped in calls), calls
    finally:
        _cleanup(proc, child)


def test_stop_does_not_signal_the_group_of_a_reaped_exporter(monkeypatch):
    proc = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    proc.wait()  # reaped: its pid may now be anyone's
    calls = _spy_killpg(monkeypatch, proc)
    quantize.stop_exporter(proc)
    assert calls == []
