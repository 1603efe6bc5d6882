"""The worker's end once its shard is committed (``batch_llm.isolation.worker_child.FastEnd``), on real processes.

A worker leading its own process group, with a child standing in for vLLM's engine-core process (the kill is
what is tested, not the engine: tests/system/test_engine_faults.py runs the real worker with a real engine
core through this path): the result line reaches the parent, the worker exits 0 at once and its child is
killed. Where the kill could reach processes that are not its own, or would skip a cleanup tensor parallelism
needs, the fast end is off. The folder vLLM's sockets go to belongs to the parent's ``WorkerHandle``, which
removes it however the worker ended (SIGKILL included).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from batch_llm.isolation.worker_child import RESULT_PREFIX

INCLUDE = str(Path(__file__).resolve().parents[2] / "include")

WORKER = textwrap.dedent("""
    import json, os, subprocess, sys, time
    from types import SimpleNamespace
    from batch_llm.isolation.worker_child import FastEnd

    tp = int(sys.argv[1])
    fast_end = FastEnd(SimpleNamespace(engine=SimpleNamespace(tensor_parallel_size=tp)))
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    print("STATE " + json.dumps({"enabled": fast_end.enabled, "child": child.pid}), flush=True)
    if fast_end.enabled:
        fast_end(SimpleNamespace(model_dump_json=lambda: '{"shard": 7}'))
    print("NOT_ENDED", flush=True)  # the fast end never returns
    child.kill()
""")


def _run(tmp_path: Path, *, tp: int = 1, own_group: bool = True):
    script = tmp_path / "worker_like.py"
    script.write_text(WORKER)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(script), str(tp)], capture_output=True, text=True, timeout=60,
                          start_new_session=own_group, env={**os.environ, "PYTHONPATH": INCLUDE})
    elapsed = time.monotonic() - t0
    lines = proc.stdout.splitlines()
    state = json.loads(next(x for x in lines if x.startswith("STATE "))[6:])
    return proc, lines, state, elapsed


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_fast_end_reports_and_kills_the_engine_processes(tmp_path):
    proc, lines, state, elapsed = _run(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert state["enabled"], state
    assert f'{RESULT_PREFIX}{{"shard": 7}}' in lines and "NOT_ENDED" not in lines, lines
    deadline = time.monotonic() + 5
    while _alive(state["child"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(state["child"]), "the engine's process outlived the worker"
    assert elapsed < 30  # the child sleeps 120 s: the worker did not wait for it


def test_fast_end_is_off_with_tensor_parallelism_or_outside_its_own_group(tmp_path):
    for kw in (dict(tp=2), dict(own_group=False)):
        proc, lines, state, _ = _run(tmp_path, **kw)
        assert not state["enabled"], (kw, state)
        assert "NOT_ENDED" in lines and not any(x.startswith(RESULT_PREFIX) for x in lines), (kw, lines)
        assert proc.returncode == 0, proc.stderr


# ------------------------------------------------------------------ vLLM's socket folder, owned by the handle
# A stand-in interpreter for WorkerHandle (its ``python``): a shell that reports the folder it was given, puts a
# socket-like file there as vLLM's engine would, and ends as a killed worker does.
KILLED_WORKER = """#!/bin/sh
echo "IPC=$VLLM_RPC_BASE_PATH"
touch "$VLLM_RPC_BASE_PATH/engine-socket" && echo "WROTE"
kill -9 $$
"""


def _stand_in(tmp_path: Path) -> str:
    exe = tmp_path / "python-stand-in"
    exe.write_text(KILLED_WORKER)
    exe.chmod(0o755)
    return str(exe)


def test_the_handle_gives_each_attempt_a_socket_folder_and_removes_it_after_a_sigkill(tmp_path):
    from batch_llm.isolation.worker_parent import WorkerFailed, WorkerHandle

    lines: list[str] = []
    h = WorkerHandle.start({}, python=_stand_in(tmp_path))
    assert h.ipc_dir and os.path.basename(h.ipc_dir).startswith("batch_llm_ipc_")
    try:
        h.wait(on_line=lines.append)
        raise AssertionError("a worker killed by SIGKILL must fail")
    except WorkerFailed as e:
        assert e.returncode == -9 and "killed by signal 9" in str(e)
    assert f"IPC={h.ipc_dir}" in lines and "WROTE" in lines, lines  # the worker had it, and wrote into it
    assert not os.path.exists(h.ipc_dir), "the killed worker's socket folder was left behind"


def test_the_handle_removes_the_folder_when_it_stops_a_worker(tmp_path):
    from batch_llm.isolation.worker_parent import WorkerHandle

    sleeper = tmp_path / "python-sleeper"
    sleeper.write_text("#!/bin/sh\nexec sleep 60\n")
    sleeper.chmod(0o755)
    h = WorkerHandle.start({}, python=str(sleeper))
    assert os.path.isdir(h.ipc_dir)
    h.stop(grace_seconds=5)
    assert h.proc.poll() is not None and not os.path.exists(h.ipc_dir)


def test_the_handle_leaves_a_socket_folder_the_user_chose(tmp_path):
    from batch_llm.isolation.worker_parent import WorkerFailed, WorkerHandle

    chosen = tmp_path / "rpc"
    chosen.mkdir()
    lines: list[str] = []
    h = WorkerHandle.start({}, python=_stand_in(tmp_path), env={"VLLM_RPC_BASE_PATH": str(chosen)})
    assert h.ipc_dir is None
    try:
        h.wait(on_line=lines.append)
    except WorkerFailed:
        pass
    assert f"IPC={chosen}" in lines and (chosen / "engine-socket").exists(), "the user's folder must stay"
