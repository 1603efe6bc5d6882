"""GPU leases: several shard tasks on one worker, each pinned to GPUs of its own, never two on one GPU.

A lease is an exclusive ``flock`` on ``<lease_dir>/gpu-<N>.lock``, held by the task process for as long as
its shard runs. The kernel drops a lock when its holder dies, however it dies, so a crashed task's GPUs are
free for the next one. Each lock file records the holder's worker process group and the start time of its
leader (``/proc/<pid>/stat``); a new holder that finds that group still alive (an orphaned engine from a
killed task) ends it first, so its memory is really free. Process ids are reused: a group is ended only when
its leader is the recorded process (same start time), or, with the leader gone, when every live member
started after it; a record without a start time ends nothing.

The lease folder is private: a record in it names a process group that the next holder signals, so nobody
else may be able to write one there. It is created 0700 (default ``/tmp/batch_llm_gpu_leases-<uid>``, or
``$BATCH_LLM_LEASE_DIR``); an existing one must be a real folder (no symlink) of this user that neither group
nor others may write, else ``LeaseDirUnsafe``. Lease files are opened inside it without following symlinks,
and a recorded group is signalled only when all its live processes are this user's.

The pool of the GPU queue carries the slot count (slots = GPUs / tensor_parallel_size); the leases decide
which GPUs a running task gets.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from batch_llm.host.gpus import visible_gpus
from batch_llm.host.procgroup import live_group_members, process_group_alive, stop_process_group

LEASE_DIR_ENV = "BATCH_LLM_LEASE_DIR"


class NoGpuFree(TimeoutError):
    pass


class LeaseDirUnsafe(PermissionError):
    """The lease folder could be written by someone else: its records would name groups we then kill."""


def default_lease_dir() -> str:
    """One folder per user: under the shared /tmp a fixed name could be created first by anyone."""
    return f"/tmp/batch_llm_gpu_leases-{os.getuid()}"


def open_private_dir(path: Path) -> int:
    """A descriptor of the lease folder ``path``, created 0700 if missing; LeaseDirUnsafe unless it is a real
    folder owned by this user without group/other write. Lease files are then opened relative to the
    descriptor, so swapping the path for another folder after this check changes nothing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    fix = (f"remove it or point ${LEASE_DIR_ENV} at a folder of your own (it is created 0700 if missing); "
           f"the default is {default_lease_dir()}")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise LeaseDirUnsafe(f"GPU lease folder {path} is a symlink or not a folder: {fix}") from None
        raise
    st = os.fstat(fd)
    problem = ("is owned by uid %d, not by this user (uid %d)" % (st.st_uid, os.getuid())
               if st.st_uid != os.getuid() else
               "may be written by group or others (mode %o)" % stat.S_IMODE(st.st_mode)
               if st.st_mode & 0o022 else None)
    if problem:
        os.close(fd)
        raise LeaseDirUnsafe(f"GPU lease folder {path} {problem}: anyone who can write there can name a process "
                             f"group the next lease kills; {fix}")
    return fd


def open_lease_file(dir_fd: int, name: str, ldir: Path) -> TextIO:
    """``name`` inside the lease folder, created 0600, never through a symlink."""
    try:
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise LeaseDirUnsafe(f"GPU lease file {ldir / name} is a symlink; remove it") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        os.close(fd)
        raise LeaseDirUnsafe(f"GPU lease file {ldir / name} is not a regular file of this user; remove it")
    return os.fdopen(fd, "r+")


def group_is_mine(pgid: int) -> bool:
    """Whether every live process of group ``pgid`` runs as this user: a worker we started does; a group of
    someone else's is never ours to end (root's killpg would reach it)."""
    me = os.getuid()
    for pid in live_group_members(pgid):
        try:
            if os.stat(f"/proc/{pid}").st_uid != me:
                return False
        except FileNotFoundError:
            continue
    return True


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/<pid>/stat from field 3 (state) on; the command name in field 2 may hold spaces and parentheses."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_start_time(pid: int) -> int | None:
    """When the process started, in clock ticks after boot (field 22 of /proc/<pid>/stat): with the pid, it
    names one process for the machine's uptime, where a pid alone is reused. None when there is no such
    process (or no /proc)."""
    fields = _stat_fields(pid)
    try:
        return int(fields[19]) if fields else None
    except (IndexError, ValueError):
        return None


def is_recorded_group(pgid: int, start: int | None) -> bool:
    """Whether the live process group ``pgid`` is the one recorded with leader start time ``start``.

    The leader alive: it must have that start time (a pid reused by another process has a later one). The
    leader gone: Linux does not hand out a pid while a group still bears it, so the group's survivors are the
    recorded leader's orphans, provided none started before the leader did. No start time recorded: unknown,
    so no."""
    if start is None:
        return False
    leader = process_start_time(pgid)
    if leader is not None:
        return leader == start
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        fields = _stat_fields(int(pid))
        try:
            if fields and int(fields[2]) == pgid and fields[0] != "Z" and int(fields[19]) < start:
                return False
        except (IndexError, ValueError):
            continue
    return True


@dataclass
class GpuLease:
    gpus: list[str]
    lease_dir: Path
    _files: list[TextIO] = field(default_factory=list, repr=False)

    @property
    def cuda_visible_devices(self) -> str:
        return ",".join(self.gpus)

    @classmethod
    def acquire(cls, count: int, *, gpus: list[str] | None = None, lease_dir: str | os.PathLike | None = None,
                timeout: float = 3600.0, poll: float = 2.0, holder: str = "") -> "GpuLease":
        """Takes ``count`` free GPUs, waiting up to ``timeout`` seconds for them."""
        gpus = visible_gpus() if gpus is None else gpus
        if count > len(gpus):
            raise ValueError(f"{count} GPU(s) asked for, this worker has {len(gpus)}: {gpus}")
        ldir = Path(lease_dir or os.environ.get(LEASE_DIR_ENV) or default_lease_dir())
        dir_fd = open_private_dir(ldir)
        try:
            return cls._acquire_in(dir_fd, ldir, count, gpus, timeout, poll, holder)
        finally:
            os.close(dir_fd)

    @classmethod
    def _acquire_in(cls, dir_fd: int, ldir: Path, count: int, gpus: list[str], timeout: float, poll: float,
                    holder: str) -> "GpuLease":
        deadline = time.monotonic() + timeout
        while True:
            taken: list[str] = []
            files: list[TextIO] = []
            try:
                cls._lock_free(dir_fd, ldir, gpus, count, taken, files)
            except BaseException:
                for f in files:
                    f.close()
                raise
            if len(taken) == count:
                lease = cls(taken, ldir, files)
                lease._reclaim_and_record(holder)
                return lease
            for f in files:
                f.close()
            if time.monotonic() >= deadline:
                raise NoGpuFree(f"no {count} free GPU(s) among {gpus} within {timeout:.0f}s (leases in {ldir})")
            time.sleep(poll)

    @staticmethod
    def _lock_free(dir_fd: int, ldir: Path, gpus: list[str], count: int, taken: list[str],
                   files: list[TextIO]) -> None:
        """Locks free GPUs' lease files until ``count`` are held, appending to ``taken`` and ``files``."""
        for g in gpus:
            f = open_lease_file(dir_fd, f"gpu-{g}.lock", ldir)
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.close()
                continue
            taken.append(g)
            files.append(f)
            if len(taken) == count:
                return

    def _reclaim_and_record(self, holder: str) -> None:
        for f in self._files:
            f.seek(0)
            try:
                prev = json.loads(f.read() or "{}")
            except ValueError:
                prev = {}
            pgid = prev.get("worker_pgid")
            if (pgid and process_group_alive(pgid) and is_recorded_group(pgid, prev.get("worker_start"))
                    and group_is_mine(pgid)):
                stop_process_group(pgid, grace_seconds=5)  # an orphan of a killed task still holds memory
            self._write(f, {"holder": holder, "pid": os.getpid(), "worker_pgid": None, "since": time.time()})

    def record_worker(self, pgid: int) -> None:
        """Remembers the worker's process group (its leader's pid, as the worker starts a session of its own)
        and the leader's start time, so a later holder can end that group, and only it, if this task dies."""
        start = process_start_time(pgid)
        for f in self._files:
            f.seek(0)
            data = json.loads(f.read() or "{}")
            self._write(f, {**data, "worker_pgid": pgid, "worker_start": start})

    @staticmethod
    def _write(f: TextIO, data: dict) -> None:
        f.seek(0)
        f.truncate()
        f.write(json.dumps(data))
        f.flush()

    def release(self) -> None:
        for f in self._files:
            try:
                self._write(f, {})
                fcntl.flock(f, fcntl.LOCK_UN)
            finally:
                f.close()
        self._files = []

    def __enter__(self) -> "GpuLease":
        return self

    def __exit__(self, *exc) -> None:
        self.release()
