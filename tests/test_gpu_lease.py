"""GPU leases without GPUs: exclusive, reclaimed when the holder dies, orphaned workers ended."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from batch_llm.gpu_lease import GpuLease, NoGpuFree
from batch_llm.worker import process_group_alive

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
        from batch_llm.gpu_lease import GpuLease
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
