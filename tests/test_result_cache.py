"""The result cache keys on everything that decides an output; concurrent writers never collide."""
from __future__ import annotations

import threading

from batch_llm import stages
from batch_llm.result_cache import ResultCache, namespace, prompt_key
from batch_llm.storage import Location
from helpers import demo_config


def test_namespace_changes_with_model_template_sampling_engine():
    base = dict(model_key="m@main#abc", chat_template="T", sampling={"temperature": 0.0, "max_tokens": 8},
                engine_kind="vllm")
    ns = namespace(**base)
    assert namespace(**base) == ns
    assert namespace(**{**base, "model_key": "m@main#abd"}) != ns
    assert namespace(**{**base, "chat_template": "T2"}) != ns
    assert namespace(**{**base, "sampling": {"temperature": 0.1, "max_tokens": 8}}) != ns
    assert prompt_key([1, 2, 3]) != prompt_key([1, 2, 4])


def test_concurrent_writers_and_union_reads(tmp_path):
    cache = ResultCache(Location(str(tmp_path)), "ns")

    def writer(i):
        cache.add([{"key": f"k{i}-{j}", "output": f"{i}-{j}", "finish_reason": "stop", "prompt_tokens": 1,
                    "completion_tokens": 1} for j in range(50)])

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    found = cache.lookup([f"k{i}-{j}" for i in range(8) for j in range(50)] + ["missing"])
    assert len(found) == 400 and found["k3-7"]["output"] == "3-7"


def test_changed_sampling_misses_on_a_real_engine(tmp_path, demo_model_dir):
    """Same day, same prompts: unchanged → all cached; max_tokens changed → nothing cached."""
    over = dict(engine__kind="transformers", sharding__num_shards=1, sampling__max_tokens=8)
    for run, extra, expect_cached in (("a", {}, 0), ("b", {}, 20), ("c", {"sampling__max_tokens": 9}, 0)):
        cfg = demo_config(tmp_path, **{**over, **extra})
        layout = stages.RunLayout.for_run(cfg, run_id=run, ds="2026-11-06")
        model = stages.fetch(cfg, layout)
        plan = stages.plan_shards(cfg, layout)
        m = stages.infer_shard(cfg, layout, model, plan["shards"][0], say=lambda _: None)
        assert m["metrics"]["cached_rows"] == expect_cached, run
