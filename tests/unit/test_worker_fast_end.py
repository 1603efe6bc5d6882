"""The worker's end once its shard is committed (``batch_llm.worker._FastEnd``), on real processes.

A worker leading its own process group, with a child standing in for vLLM's engine-core process (the kill is
what is tested, not the engine: tests/system/test_engine_faults.py runs the real worker with a real engine
core through this path): the result line reaches the parent, the worker exits 0 at once, its child is
killed, and the socket folder it gave vLLM is gone. Where the kill could reach processes that are not its
own, or would skip a cleanup tensor parallelism needs, the fast end is off.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from batch_llm.worker import RESULT_PREFIX

INCLUDE = str(Path(__file__).resolve().parents[2] / "include")

WORKER = textwrap.dedent("""
    import json, os, subprocess, sys, time
    from types import SimpleNamespace
    from batch_llm.worker import _FastEnd

    tp = int(sys.argv[1])
    fast_end = _FastEnd(SimpleNamespace(engine=SimpleNamespace(tensor_parallel_size=tp)))
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    ipc = os.environ.get("VLLM_RPC_BASE_PATH")
    if fast_end.ipc_dir:
        open(os.path.join(ipc, "engine-socket"), "w").close()  # as vLLM's ipc:// sockets sit there
    print("STATE " + json.dumps({"enabled": fast_end.enabled, "child": child.pid, "ipc": ipc,
                                 "own_ipc": fast_end.ipc_dir}), flush=True)
    if fast_end.enabled:
        fast_end(SimpleNamespace(model_dump_json=lambda: '{"shard": 7}'))
    print("NOT_ENDED", flush=True)  # the fast end never returns
    child.kill()
""")


def _run(tmp_path: Path, *, tp: int = 1, own_group: bool = True, env: dict | None = None):
    script = tmp_path / "worker_like.py"
    script.write_text(WORKER)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(script), str(tp)], capture_output=True, text=True, timeout=60,
                          start_new_session=own_group,
                          env={**{k: v for k, v in os.environ.items() if k != "VLLM_RPC_BASE_PATH"},
                               "PYTHONPATH": INCLUDE, **(env or {})})
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


def test_fast_end_reports_kills_the_engine_processes_and_removes_their_sockets(tmp_path):
    proc, lines, state, elapsed = _run(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert state["enabled"] and state["own_ipc"] == state["ipc"], state
    assert f'{RESULT_PREFIX}{{"shard": 7}}' in lines and "NOT_ENDED" not in lines, lines
    deadline = time.monotonic() + 5
    while _alive(state["child"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(state["child"]), "the engine's process outlived the worker"
    assert not os.path.exists(state["ipc"]), "vLLM's socket folder was left behind"
    assert elapsed < 30  # the child sleeps 120 s: the worker did not wait for it


def test_fast_end_is_off_with_tensor_parallelism_or_outside_its_own_group(tmp_path):
    for kw in (dict(tp=2), dict(own_group=False)):
        proc, lines, state, _ = _run(tmp_path, **kw)
        assert not state["enabled"] and state["own_ipc"] is None, (kw, state)
        assert "NOT_ENDED" in lines and not any(x.startswith(RESULT_PREFIX) for x in lines), (kw, lines)
        assert proc.returncode == 0, proc.stderr


def test_fast_end_leaves_a_socket_folder_the_user_chose(tmp_path):
    chosen = tmp_path / "rpc"
    chosen.mkdir()
    proc, lines, state, _ = _run(tmp_path, env={"VLLM_RPC_BASE_PATH": str(chosen)})
    assert state["enabled"] and state["own_ipc"] is None and state["ipc"] == str(chosen), state
    assert proc.returncode == 0 and chosen.is_dir(), "the user's folder must stay"
