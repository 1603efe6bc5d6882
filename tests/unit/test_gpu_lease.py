"""GPU leases without GPUs: exclusive, reclaimed when the holder dies, orphaned workers ended."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
from batch_llm.host.procgroup import process_group_alive
from batch_llm.isolation.gpu_lease import GpuLease, NoGpuFree

GPUS = ["0", "1", "2", "3"]


def test_leases_never_share_a_gpu(tmp_path):
    a = GpuLease.acquire(2, gpus=GPUS, lease_dir=tmp_path, timeout=1)
    b = GpuLease.acquire(2, gpus=GPUS, lease_dir=tmp_path, timeout=1)
    assert set(a.gpus).isdisjoint(b.gpus) and len(a.gpus) == len(b.gpus) == 2
    with pytest.raises(NoGpuFree):
        GpuLease.acquire(1, gpus=GPUS, lease_dir=tmp_path, timeout=0.5, poll=0.1)
    a.release()
    c = GpuLease.acquire(1, gpus=GPUS, lease_dir=tmp_path, timeout=1)
    assert c.gpus[0] in a.gpus and c.cuda_visible_devices == c.gpus[0]
    b.release(), c.release()


def test_asking_for_more_gpus_than_the_worker_has(tmp_path):
    with pytest.raises(ValueError, match="2 GPU"):
        GpuLease.acquire(2, gpus=["0"], lease_dir=tmp_path)


def test_lease_of_a_killed_task_is_reclaimed_and_its_orphan_ended(tmp_path):
    # A "task" takes GPU 0, starts a worker in its own process group, records it, then dies by SIGKILL.
    script = textwrap.dedent(f"""
        import subprocess, sys, time
        from batch_llm.isolation.gpu_lease import GpuLease
        lease = GpuLease.acquire(1, gpus=["0"], lease_dir={str(tmp_path)!r}, timeout=5)
        worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
        lease.record_worker(worker.pid)
        print(worker.pid, flush=True)
        time.sleep(600)
    """)
    task = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    orphan = int(task.stdout.readline())
    with pytest.raises(NoGpuFree):
        GpuLease.acquire(1, gpus=["0"], lease_dir=tmp_path, timeout=0.5, poll=0.1)
    task.kill()
    task.wait()
    assert process_group_alive(orphan)  # the orphan outlived its task, still "holding the GPU"
    t0 = time.monotonic()
    lease = GpuLease.acquire(1, gpus=["0"], lease_dir=tmp_path, timeout=5, poll=0.1)
    assert lease.gpus == ["0"] and time.monotonic() - t0 < 10
    assert not process_group_alive(orphan)
    lease.release()


def _own_session(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True, stdout=subprocess.PIPE, text=True)


def test_a_reused_pid_is_not_killed(tmp_path):
    """The lease names a worker group whose leader's start time is not the live process's: the pid was reused
    by an unrelated process (here: one started after the record's start time), which must survive."""
    import json

    from batch_llm.isolation.gpu_lease import process_start_time

    innocent = _own_session("import time; time.sleep(600)")
    try:
        start = process_start_time(innocent.pid)
        assert start is not None
        (tmp_path / "gpu-0.lock").write_text(json.dumps({"holder": "dead task", "pid": 1,
                                                         "worker_pgid": innocent.pid, "worker_start": start - 1}))
        lease = GpuLease.acquire(1, gpus=["0"], lease_dir=tmp_path, timeout=5, poll=0.1)
        time.sleep(0.3)
        assert innocent.poll() is None and process_group_alive(innocent.pid), "an unrelated process was killed"
        lease.release()
        # a record without a start time cannot be checked: nothing is killed either
        (tmp_path / "gpu-0.lock").write_text(json.dumps({"worker_pgid": innocent.pid}))
        GpuLease.acquire(1, gpus=["0"], lease_dir=tmp_path, timeout=5, poll=0.1).release()
        assert innocent.poll() is None
    finally:
        innocent.kill()
        innocent.wait()


def test_orphans_of_a_dead_worker_leader_are_ended(tmp_path):
    """The worker (group leader) died, its engine process lives on in the group: the recorded start time is
    the dead leader's, the survivor started after it, so the group is the recorded one and is ended."""
    from batch_llm.isolation.gpu_lease import is_recorded_group, process_start_time

    leader = _own_session(textwrap.dedent("""
        import subprocess, sys
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print(child.pid, flush=True)
    """))
    pgid = leader.pid
    start = process_start_time(pgid)
    orphan = int(leader.stdout.readline())
    leader.wait()
    assert process_start_time(pgid) is None and process_group_alive(pgid)  # leader gone, the group lives
    try:
        assert not is_recorded_group(pgid, process_start_time(orphan) + 1)  # a member older than the record: no
        import json

        (tmp_path / "gpu-0.lock").write_text(json.dumps({"worker_pgid": pgid, "worker_start": start}))
        GpuLease.acquire(1, gpus=["0"], lease_dir=tmp_path, timeout=10, poll=0.1).release()
        deadline = time.monotonic() + 10
        while process_group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not process_group_alive(pgid)
    finally:
        if process_group_alive(pgid):
            os.killpg(pgid, 9)


# ------------------------------------------------------------------------------------ a private lease folder
# A lease record names a process group that the next holder kills: only this user may be able to write one.
def test_the_lease_folder_is_made_private_and_per_user(tmp_path, monkeypatch):
    from batch_llm.isolation import gpu_lease

    assert str(os.getuid()) in gpu_lease.default_lease_dir()  # not one fixed name anyone may create first
    monkeypatch.setenv("BATCH_LLM_LEASE_DIR", str(tmp_path / "leases"))
    old = os.umask(0o022)  # a usual umask; mkdir's mode alone would give 0755
    try:
        GpuLease.acquire(1, gpus=["0"], timeout=1).release()
    finally:
        os.umask(old)
    assert (tmp_path / "leases").stat().st_mode & 0o777 == 0o700


def test_a_symlinked_lease_folder_is_refused(tmp_path):
    (tmp_path / "real").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(PermissionError, match=f"{tmp_path / 'link'} is a symlink.*BATCH_LLM_LEASE_DIR"):
        GpuLease.acquire(1, gpus=["0"], lease_dir=tmp_path / "link", timeout=1)
    assert not list((tmp_path / "real").iterdir())


def test_a_lease_folder_others_may_write_is_refused(tmp_path):
    ldir = tmp_path / "leases"
    ldir.mkdir()
    ldir.chmod(0o777)
    with pytest.raises(PermissionError, match="written by group or others"):
        GpuLease.acquire(1, gpus=["0"], lease_dir=ldir, timeout=1)


def test_a_lease_folder_of_another_user_is_refused(tmp_path, monkeypatch):
    ldir = tmp_path / "leases"
    ldir.mkdir(mode=0o700)
    if os.getuid() == 0:
        os.chown(ldir, 65534, 65534)
    else:  # cannot give the folder away: be someone else instead
        real = os.getuid()
        monkeypatch.setattr(os, "getuid", lambda: real + 1)
    with pytest.raises(PermissionError, match="owned by uid"):
        GpuLease.acquire(1, gpus=["0"], lease_dir=ldir, timeout=1)


def test_a_symlinked_lease_file_is_not_followed(tmp_path):
    ldir = tmp_path / "leases"
    ldir.mkdir(mode=0o700)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    (ldir / "gpu-0.lock").symlink_to(victim)
    with pytest.raises(PermissionError, match="gpu-0.lock is a symlink"):
        GpuLease.acquire(1, gpus=["0"], lease_dir=ldir, timeout=1)
    assert victim.read_text() == "keep"


@pytest.mark.skipif(os.getuid() != 0, reason="starting a process of another user needs root")
def test_a_recorded_group_of_another_user_is_not_killed(tmp_path):
    """Root's killpg reaches every process: a record naming another user's group (whatever wrote it) is left
    alone, even when the start time matches."""
    import json

    from batch_llm.isolation.gpu_lease import process_start_time

    other = subprocess.Popen(["sleep", "600"], start_new_session=True, user=65534)
    try:
        record = {"worker_pgid": other.pid, "worker_start": process_start_time(other.pid)}
        (tmp_path / "gpu-0.lock").write_text(json.dumps(record))
        GpuLease.acquire(1, gpus=["0"], lease_dir=tmp_path, timeout=5, poll=0.1).release()
        time.sleep(0.3)
        assert other.poll() is None, "another user's process group was killed"
    finally:
        other.kill()
        other.wait()
