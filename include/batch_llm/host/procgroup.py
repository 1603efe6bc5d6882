"""Process groups: ending a child that leads a group of its own, and every process it started.

A worker (``worker.WorkerHandle``) and a quantize exporter run in a session of their own, so their engine or
export processes share the leader's process group and one ``killpg`` reaches them all. The group is named by
the leader's pid, which names it only until the leader is reaped (then the pid may be anyone's): ``GroupLeader``
signals only an unreaped leader and reaps it after the group is gone.

Standard library only: ``gpu_lease``, ``quantize`` and the worker use it from their own floors.
"""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time


class GroupLeader:
    """A child process leading a process group (session) of its own, ended with its whole group."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        # The group is signalled by the leader's pid, which names the group only until the leader is reaped
        # (then the pid may be reused): the handle reaps it only after signalling, under this lock. Reentrant:
        # stop() runs from on_kill, Airflow's SIGTERM handler, possibly in the middle of wait()'s own end.
        self._group_lock = threading.RLock()
        self._reaping = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, grace_seconds: float = 10.0) -> None:
        """Ends the leader's whole process group and waits for it, then reaps the leader."""
        self._end_group(grace_seconds)

    def _leader_exited(self) -> bool:
        """Whether the leader has exited, without reaping it (WNOWAIT): a zombie still holds its pid."""
        if self.proc.returncode is not None:
            return True
        try:
            return os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:  # reaped already
            return True

    def _wait_leader_exit(self) -> None:
        """Blocks until the leader exits, leaving it unreaped (Popen.wait would reap it)."""
        if self.proc.returncode is None:
            try:
                os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOWAIT)
            except ChildProcessError:
                pass

    def _signal_group(self, sig: int) -> bool:
        """Sends ``sig`` to the leader's group while the leader is unreaped; False once there is no group to
        signal: after the reap the pid may name someone else's group."""
        if self.proc.returncode is not None or self._reaping:
            return False
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            return False
        return True

    def _end_group(self, grace_seconds: float) -> None:
        """SIGTERM, then SIGKILL, to the group until no live member is left, then reaps the leader."""
        with self._group_lock:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                if not self._signal_group(sig) or _wait_group_gone(self.proc.pid, grace_seconds):
                    break
            if self._reaping:  # re-entered (on_kill during wait's end): the outer call reaps
                return
            self._reaping = True
            try:
                self.proc.wait(timeout=grace_seconds)
            except subprocess.TimeoutExpired:
                pass
            finally:
                self._reaping = False


def stop_process_group(pgid: int, grace_seconds: float = 10.0) -> None:
    """SIGTERM, then SIGKILL, to group ``pgid``. The caller makes sure ``pgid`` is still the group it means
    (``WorkerHandle`` keeps the leader unreaped; a GPU lease checks the leader's start time)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        if _wait_group_gone(pgid, grace_seconds):
            return


def _wait_group_gone(pgid: int, grace_seconds: float) -> bool:
    """Whether group ``pgid`` has no live member left within ``grace_seconds``."""
    deadline = time.monotonic() + grace_seconds
    while time.monotonic() < deadline:
        if not live_group_members(pgid):
            return True
        time.sleep(0.1)
    return False


def process_group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return bool(live_group_members(pgid))  # zombies still count for killpg


def live_group_members(pgid: int) -> list[int]:
    """The pids of a process group's live (not zombie) members, from /proc (Linux). A zombie has released its
    memory and its GPU context already."""
    members = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[2]) == pgid and fields[0] != "Z":
                    members.append(int(pid))
            except (OSError, IndexError, ValueError):
                continue
    return members
