"""The result cache on a real engine (transformers, the demo model): a changed sampling setting misses."""
from __future__ import annotations

from batch_llm import api
from batch_llm.layout import RunLayout
from helpers import demo_config


def test_changed_sampling_misses_on_a_real_engine(tmp_path, demo_model_dir):
    """Same day, same prompts: unchanged → all cached; max_tokens changed → nothing cached."""
    over = dict(engine__kind="transformers", sharding__num_shards=1, sampling__max_tokens=8)
    for run, extra, expect_cached in (("a", {}, 0), ("b", {}, 20), ("c", {"sampling__max_tokens": 9}, 0)):
        cfg = demo_config(tmp_path, **{**over, **extra})
        layout = RunLayout.for_run(cfg, run_id=run, ds="2026-11-06")
        model = api.fetch(cfg, layout)
        plan = api.plan_shards(cfg, layout)
        m = api.infer_shard(cfg, layout, model, plan.shards[0], say=lambda _: None)
        assert m.metrics.cached_rows == expect_cached, run
