"""Faults a GPU fleet has, on the real CPU vLLM engine.

* The engine-core process (a child of the worker, not the worker itself; engine.multiprocessing on, as on
  GPUs) is killed with SIGKILL mid-shard, as the kernel's OOM killer or a crashed GPU does it: the shard fails
  as a retryable worker failure, not as error rows and not as a hang; the retry resumes and ends with every
  row exactly once and no error rows.
* In one process: a request vLLM refuses (a prompt longer than the context) is an error row; once the engine
  is dead, further requests raise ``EngineFailed`` instead of becoming rows the engine "rejected".
* The memory classifier on real vLLM output: a KV cache too small for max_model_len is a memory failure; a
  model folder with a broken config is not, nor are the lines a healthy start prints (the worker's first
  attempt runs with vLLM's debug log and stats on, so its output has "num_gpu_blocks is: 100").
"""
from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest
from batch_llm import api
from batch_llm.engines.base import EngineFailed, EngineStartError, GenRequest, classify_start_failure
from batch_llm.io.storage import Location, iter_jsonl, list_files, read_json
from batch_llm.isolation.worker_child import EXIT_ERROR
from batch_llm.isolation.worker_parent import WorkerFailed, WorkerHandle
from batch_llm.layout import RunLayout
from helpers import demo_config

ROWS = 20  # valid rows of the bundled demo prompts
# SmolLM2-135M keeps 23,040 bytes of KV cache a token; the CPU backend's blocks hold 128 tokens: 100 blocks.
KV_100_BLOCKS = 100 * 128 * 23040
HANG_LIMIT = 240  # seconds: the first attempt must end well before this (the old code waited forever)


def _prepare(tmp, run_id, **over):
    cfg = demo_config(tmp, **{**dict(engine__kind="vllm", engine__enforce_eager=True, engine__max_model_len=512,
                                     engine__max_num_seqs=2,  # two rows at a time: rows finish over the shard
                                     engine__commit_every_rows=1, sharding__num_shards=1, sampling__max_tokens=16,
                                     sampling__ignore_eos=True, cache__enabled=False), **over})
    layout = RunLayout.for_run(cfg, run_id=run_id, ds="2026-11-04")
    model = api.fetch(cfg, layout)
    plan = api.plan_shards(cfg, layout)
    spec = {"config": cfg.model_dump(mode="json"), "layout": layout.to_dict(), "model": model.ref().model_dump(),
            "shard": plan.shards[0].model_dump()}
    return layout, spec


def _shard_dir(layout) -> Location:
    return layout.stage("infer").child("shard-00000")


def _chunk_rows(layout) -> list[dict]:
    return [r for f in list_files(_shard_dir(layout).child("chunks").path(), ".jsonl") for r in iter_jsonl(f)]


def _engine_core_children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` and whose name is vLLM's engine core ("VLLM::EngineCore")."""
    out = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/stat") as f:
                name, rest = f.read().split("(", 1)[1].rsplit(")", 1)
        except (OSError, IndexError, ValueError):
            continue
        if int(rest.split()[1]) == pid and name.startswith("VLLM::EngineCor"):
            out.append(int(p))
    return out


@pytest.fixture(scope="module")
def killed_mid_shard(tmp_path_factory, demo_model_dir):
    """First attempt of a shard whose engine core is killed once the first row is committed."""
    layout, spec = _prepare(tmp_path_factory.mktemp("kill"), "engine-core-killed", engine__multiprocessing=True,
                            engine__extra={"kv_cache_memory_bytes": KV_100_BLOCKS, "disable_log_stats": False})
    lines: list[str] = []
    failure: list[BaseException] = []
    handle = WorkerHandle.start(spec, env={"VLLM_LOGGING_LEVEL": "DEBUG"})

    def wait() -> None:  # reads the worker's output all along (a full pipe would stall it)
        try:
            handle.wait(on_line=lines.append)
        except WorkerFailed as e:
            failure.append(e)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    chunks = _shard_dir(layout).child("chunks").path()
    deadline = time.monotonic() + HANG_LIMIT
    while not list_files(chunks, ".jsonl") and time.monotonic() < deadline and handle.proc.poll() is None:
        time.sleep(0.05)
    killed = _engine_core_children(handle.pid)
    for pid in killed:
        os.kill(pid, signal.SIGKILL)
    t_kill = time.monotonic()
    waiter.join(HANG_LIMIT)
    ended_after = time.monotonic() - t_kill
    if waiter.is_alive():  # the old code waited forever here: end it, and fail below
        handle.stop()
        waiter.join(30)
    return dict(layout=layout, spec=spec, lines=lines, killed=killed, failure=failure[0] if failure else None,
                ended_after=ended_after,
                worker_pid=handle.pid)


def test_killed_engine_core_fails_the_shard_retryably_and_the_retry_resumes(killed_mid_shard):
    k = killed_mid_shard
    assert k["killed"] and k["worker_pid"] not in k["killed"], "the engine core, a child of the worker, was killed"
    e = k["failure"]
    assert isinstance(e, WorkerFailed), "the shard must fail when its engine dies"
    assert e.returncode == EXIT_ERROR and e.retryable, (e.returncode, str(e))  # not EXIT_SHARD_FAILED, not a hang
    assert "EngineFailed" in str(e) and "EngineDeadError" in str(e), str(e)
    assert k["ended_after"] < 60, f"the worker took {k['ended_after']:.0f}s to notice its engine died"
    layout = k["layout"]
    first = _chunk_rows(layout)
    assert 0 < len(first) < ROWS, f"the first attempt must be incomplete: {len(first)} rows committed"
    assert all(r["error"] is None for r in first), "a dead engine must not leave error rows"
    assert not (_shard_dir(layout).path() / "manifest.json").exists()

    lines: list[str] = []
    manifest = WorkerHandle.start(k["spec"]).wait(on_line=lines.append)
    assert any(f"{len({r['id'] for r in first})} rows already committed" in line for line in lines), lines[-5:]
    rows = _chunk_rows(layout)
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)) == ROWS, "a row was committed twice or lost"
    assert all(r["error"] is None for r in rows)
    m = read_json(_shard_dir(layout).path() / "manifest.json")["metrics"]
    assert (m["rows"], m["ok"], m["errors"]) == (ROWS, ROWS, 0) == (manifest["metrics"]["rows"], ROWS, 0)
    outputs = list(iter_jsonl(_shard_dir(layout).child("outputs.jsonl").path()))
    assert len(outputs) == ROWS and all(r["completion_tokens"] == 16 for r in outputs)


@pytest.fixture(scope="module")
def memory_failure(tmp_path_factory, demo_model_dir):
    """A real vLLM start that fails for memory: a KV cache of ~1.7k tokens for max_model_len 8192."""
    from batch_llm.engines.vllm_engine import VllmEngine

    cfg = demo_config(tmp_path_factory.mktemp("mem"), engine__max_model_len=8192,
                      engine__extra={"kv_cache_memory_bytes": 40 * 1024 * 1024})
    with pytest.raises(EngineStartError) as ei:
        VllmEngine(str(demo_model_dir), cfg.engine, cfg.sampling).start()
    return ei.value


@pytest.fixture(scope="module")
def broken_config_failure(tmp_path_factory):
    """A real vLLM start that fails for something else: a model folder whose config names no known model."""
    from batch_llm.engines.vllm_engine import VllmEngine

    tmp = tmp_path_factory.mktemp("broken")
    bad = tmp / "not_a_model"
    bad.mkdir()
    (bad / "config.json").write_text('{"architectures": ["NoSuchModelForCausalLM"], "model_type": "nosuch"}')
    cfg = demo_config(tmp)
    with pytest.raises(EngineStartError) as ei:
        VllmEngine(str(bad), cfg.engine, cfg.sampling).start()
    return ei.value


def test_memory_classifier_on_real_vllm_output(memory_failure, broken_config_failure, killed_mid_shard):
    mem, other = memory_failure, broken_config_failure
    assert mem.output and other.output  # what the classifier read: the exception chain and the engine's output
    memory, suggested = classify_start_failure(mem.output)
    assert memory and mem.memory and suggested and 512 <= suggested < 8192, mem.output[-2000:]
    assert classify_start_failure(other.output) == (False, None) and not other.memory, other.output[-2000:]

    healthy = "\n".join(killed_mid_shard["lines"])  # a start that worked, with vLLM's debug log and stats on
    blocks = [line for line in healthy.splitlines() if "num_gpu_blocks is:" in line]
    assert blocks and re.search(r"num_gpu_blocks is: \d*0", blocks[0]), blocks  # what `num_gpu_blocks.*0` hit
    assert "KV cache size" in healthy
    assert classify_start_failure(healthy) == (False, None)
    # A non-memory failure whose output also holds a healthy start's lines is still not a memory failure.
    assert classify_start_failure(healthy + "\n" + other.output) == (False, None)
    assert classify_start_failure(healthy + "\n" + mem.output)[0]


def test_dead_engine_raises_instead_of_turning_requests_into_error_rows(tmp_path, demo_model_dir):
    from batch_llm.engines.vllm_engine import VllmEngine

    cfg = demo_config(tmp_path, engine__max_model_len=256, engine__max_num_seqs=4, engine__enforce_eager=True,
                      engine__multiprocessing=True, sampling__max_tokens=8)  # an engine-core process to kill
    engine = VllmEngine(str(demo_model_dir), cfg.engine, cfg.sampling)
    engine.start()
    try:
        ids = [1, 28120, 30, 2]
        got = {r.key: r for r in engine.generate([GenRequest("ok", ids), GenRequest("too-long", ids * 100)])}
        assert got["ok"].error is None and got["ok"].completion_tokens > 0
        assert got["too-long"].error and got["too-long"].error.startswith("engine rejected the request"), \
            "a request vLLM refuses is that row's error"

        core = engine.llm.llm_engine.engine_core
        for p in core.resources.engine_manager.processes:  # the engine-core process, not this one
            os.kill(p.pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while not core.resources.engine_dead and time.monotonic() < deadline:
            time.sleep(0.1)
        rows = []
        with pytest.raises(EngineFailed, match="EngineDeadError"):
            for r in engine.generate(GenRequest(f"r{i}", ids) for i in range(5)):
                rows.append(r)
        assert rows == [], "requests after the engine died must not become error rows"
    finally:
        engine.close()
