"""The shard's submission order changes nothing a row gets: the demo pipeline run on the real vLLM engine with the
planner's order (largest output budget first, then prompt length: ``sharding.sort_by_length``) and in input order
publishes the same rows, in input order, with the same text, at temperature 0.

The engine serves one sequence at a time with prefix caching off in both runs, so each row's greedy text depends on
its own prompt alone (a batch's make-up may change a float's last bits, and with it a near-tie's argmax): what is
compared is the stage's reordering and its restoring of input order, not the engine's batch invariance."""
from __future__ import annotations

import json

from batch_llm.io.storage import Location, iter_jsonl
from helpers import ROOT, run_demo_cli

DS = "2026-12-06"
DEMO_INPUT = ROOT / "include" / "sample_data" / "demo_prompts.jsonl"
SETS = ["engine.kind=vllm", "sampling.max_tokens=8", "sampling.temperature=0", "evaluate.enabled=false",
        "cache.enabled=false", "sharding.num_shards=1",
        'engine.extra={"max_num_seqs": 1, "enable_prefix_caching": false}']


def _shard_ids(summary: dict) -> list[str]:
    """The ids in the order the plan wrote the shard (the order the engine was fed)."""
    (spec,) = summary["manifests"]["plan"]["shards"]
    return [r["id"] for r in iter_jsonl(Location(spec["url"]).path())]


def test_outputs_are_the_same_rows_in_input_order_whatever_the_shards_order(tmp_path, demo_model_dir):
    runs = {}
    for sort in ("true", "false"):
        current, summary, _ = run_demo_cli(DEMO_INPUT, tmp_path / sort, ds=DS, run_id=f"order-{sort}",
                                           sets=[*SETS, f"sharding.sort_by_length={sort}"])
        published = [(r["id"], r["output"]) for r in iter_jsonl(Location(current["dataset"]).path())]
        runs[sort] = published, _shard_ids(summary)
    (sorted_rows, sorted_feed), (input_rows, input_feed) = runs["true"], runs["false"]
    input_ids = []  # the demo input holds malformed lines too: the ids of those that read, in input order
    for line in DEMO_INPUT.read_text().splitlines():
        try:
            input_ids.append(json.loads(line)["id"])
        except (ValueError, KeyError, TypeError):
            pass
    published = {i for i, _ in sorted_rows}
    in_order = [i for i in dict.fromkeys(input_ids) if i in published]  # a repeated id is its later line's error
    assert len(published) >= 10 and [i for i, _ in sorted_rows] == in_order
    assert input_feed == in_order and sorted(sorted_feed) == sorted(in_order)
    assert sorted_feed != in_order  # the engine really was fed in another order
    assert sorted_rows == input_rows
    assert all(text for _, text in sorted_rows)
