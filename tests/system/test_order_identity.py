"""The shard's submission order changes nothing a row gets: the demo pipeline run on the real vLLM engine with the
planner's order (largest output budget first, then prompt length: ``sharding.sort_by_length``), with rows that share
a prompt prefix grouped (``sharding.group_prefixes``) and in input order publishes the same rows, in input order,
with the same text, at temperature 0; so does a later run ordered by the output lengths the first recorded
(``sharding.length_history``). Half the demo's prompts get one of two long preambles of one length, in turn, so
the three orders differ (by length the two preambles' rows interleave; grouped, each preamble's are one run).

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


PREAMBLES = ("Answer the question below in one short sentence, the way a patient teacher would, with no preamble. ",
             "Reply to the question below in a single brief sentence, as a careful tutor would, with no lead-ins. ")
ORDERS = {"length": ["sharding.sort_by_length=true", "sharding.group_prefixes=false"],
          "grouped": ["sharding.sort_by_length=true", "sharding.group_prefixes=true"],
          "input": ["sharding.sort_by_length=false"]}


def _with_preambles(dst) -> None:
    """The demo input, every other plain prompt behind one of PREAMBLES in turn (malformed lines and repeated ids as
    they are)."""
    lines, seen, plain = [], set(), 0
    for line in DEMO_INPUT.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        first = isinstance(row, dict) and row.get("id") not in seen
        if isinstance(row, dict):
            seen.add(row.get("id"))
        if first and isinstance(row.get("prompt"), str):
            if plain % 2:
                line = json.dumps({**row, "prompt": PREAMBLES[plain // 2 % 2] + row["prompt"]})
            plain += 1
        lines.append(line)
    dst.write_text("\n".join(lines) + "\n")


def _preambled(src, preamble: str) -> set[str]:
    ids = set()
    for line in src.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and str(row.get("prompt", "")).startswith(preamble):
            ids.add(row.get("id"))
    return ids


def test_outputs_are_the_same_rows_in_input_order_whatever_the_shards_order(tmp_path, demo_model_dir):
    src = tmp_path / "prompts.jsonl"
    _with_preambles(src)
    runs = {}
    for name, sets in ORDERS.items():
        current, summary, _ = run_demo_cli(src, tmp_path / name, ds=DS, run_id=f"order-{name}", sets=[*SETS, *sets])
        published = [(r["id"], r["output"]) for r in iter_jsonl(Location(current["dataset"]).path())]
        runs[name] = published, _shard_ids(summary)
    # a later run beside the length-order one: its plan reads the output lengths that run recorded per prompt group
    # (sharding.length_history), and only the order may change
    current, summary, _ = run_demo_cli(src, tmp_path / "length", ds=DS, run_id="order-history",
                                       sets=[*SETS, *ORDERS["length"]])
    history_rows = [(r["id"], r["output"]) for r in iter_jsonl(Location(current["dataset"]).path())]
    plan = summary["manifests"]["plan"]
    assert plan["order"] == "history, length" and plan["length_history"]["files"] == 1, plan
    assert plan["length_history"]["groups"] == 2  # the two preambles' (the demo's own prompts are under 64 bytes)
    (sorted_rows, sorted_feed), (input_rows, input_feed) = runs["length"], runs["input"]
    grouped_rows, grouped_feed = runs["grouped"]
    input_ids = []  # the demo input holds malformed lines too: the ids of those that read, in input order
    for line in src.read_text().splitlines():
        try:
            input_ids.append(json.loads(line)["id"])
        except (ValueError, KeyError, TypeError):
            pass
    published = {i for i, _ in sorted_rows}
    in_order = [i for i in dict.fromkeys(input_ids) if i in published]  # a repeated id is its later line's error
    assert len(published) >= 10 and [i for i, _ in sorted_rows] == in_order
    assert input_feed == in_order and sorted(sorted_feed) == sorted(in_order)
    assert sorted_feed != in_order  # the engine really was fed in another order
    assert sorted(grouped_feed) == sorted(in_order) and grouped_feed not in (in_order, sorted_feed)
    for preamble in PREAMBLES:  # each preamble's rows are one run in the grouped feed, not in the length order
        preambled = [i for i in grouped_feed if i in _preambled(src, preamble)]
        start = grouped_feed.index(preambled[0])
        assert grouped_feed[start:start + len(preambled)] == preambled and len(preambled) >= 3
    runs_by_length = [i in _preambled(src, PREAMBLES[0]) for i in sorted_feed if i in _preambled(src, PREAMBLES[0])
                      or i in _preambled(src, PREAMBLES[1])]
    assert sum(a != b for a, b in zip(runs_by_length, runs_by_length[1:])) > 1  # by length they interleave
    assert sorted_rows == input_rows == grouped_rows == history_rows
    assert all(text for _, text in sorted_rows)
