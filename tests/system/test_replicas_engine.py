"""engine.replicas on the real vLLM CPU engine: a shard served by two engines, each in its engine-core process,
writes the rows one engine writes (greedy), and its manifest says two replicas served it; started beside the
generation (the default), the second vLLM engine comes up on a background thread while the first serves, and the
rows are the same again; on a CPU, where the engine core runs in-process unless engine.multiprocessing says
otherwise, replicas are refused saying so."""
from __future__ import annotations

import pytest
from batch_llm import api
from batch_llm.engines.base import EngineCannotRun
from batch_llm.engines.start import start_engine
from batch_llm.io.storage import iter_jsonl
from batch_llm.layout import RunLayout
from helpers import demo_config


def _shard(tmp, run_id: str, said: list[str], **over):
    cfg = demo_config(tmp, engine__enforce_eager=True, engine__max_model_len=512, engine__max_num_seqs=4,
                      sharding__num_shards=1, sampling__max_tokens=8, cache__enabled=False, **over)
    layout = RunLayout.for_run(cfg, run_id=run_id, ds="2026-12-07")
    model = api.fetch(cfg, layout)
    plan = api.plan_shards(cfg, layout)
    manifest = api.infer_shard(cfg, layout, model, plan.shards[0].model_dump(), say=said.append)
    rows = iter_jsonl(layout.stage("infer").child("shard-00000", "outputs.jsonl").path())
    return manifest, {r["id"]: r["output"] for r in rows}


def test_two_replicas_write_the_rows_one_engine_writes(tmp_path, demo_model_dir):
    said: list[str] = []
    one, expected = _shard(tmp_path / "one", "replicas-1", said)
    two, got = _shard(tmp_path / "two", "replicas-2", said, engine__replicas=2, engine__multiprocessing=True,
                      engine__replica_start="before")
    assert len(expected) == 20 and all(expected.values())
    assert got == expected  # greedy: each row as one engine wrote it, whichever replica served it
    s = two.engine.settings
    assert s["replicas"] == s["replicas_started"] == 2 and s["multiprocessing"] is True
    assert sum(s["replica_requests"]) == 20 and min(s["replica_requests"]) >= 5, s["replica_requests"]  # both served
    assert "replicas" not in one.engine.settings
    assert len(two.engine.attempts) == 2 and all(a.get("ok") for a in two.engine.attempts)  # one start each
    assert any(line.startswith("engine replica 2 of 2 started") for line in said)
    said.clear()
    beside, got = _shard(tmp_path / "beside", "replicas-beside", said, engine__replicas=2,
                         engine__multiprocessing=True)
    assert got == expected
    s = beside.engine.settings
    assert s["replica_start"] == "beside" and sum(s["replica_requests"]) == 20
    assert len(beside.engine.attempts) == 1  # the shard waited for the first start alone
    # the second came up on its thread (joining if the 20 rows were not done yet, else closed once up)
    assert any(line.startswith("engine replica 2 of 2 started in") and "beside the generation" in line
               for line in said), said


def test_replicas_on_a_cpu_need_engine_core_processes(tmp_path, demo_model_dir):
    cfg = demo_config(tmp_path, engine__replicas=2, engine__enforce_eager=True)  # multiprocessing: its CPU default
    with pytest.raises(EngineCannotRun, match=r"engine.replicas: 2 needs each engine core in a process of its own.*"
                                              r"set engine.multiprocessing: true"):
        start_engine(str(demo_model_dir), cfg, print)
