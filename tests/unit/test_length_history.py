"""The output-length history (``cache/lengths.py``, ``sharding.length_history``): shards record what they generated
per prompt prefix group; the next plan puts the rows whose template really generates longest first, where their
budgets are all alike; the store stays bounded, a broken record is skipped, and only the order changes."""
from __future__ import annotations

import json

import pytest
from batch_llm import api
from batch_llm.cache.lengths import HISTORY_LEVELS, MIN_ROWS, LengthHistory, LengthRecorder, store_for
from batch_llm.engines.base import EngineInfo, GenResult
from batch_llm.io.storage import Location, iter_jsonl
from batch_llm.layout import RunLayout
from batch_llm.rows.prefix import prefix_groups, prompt_bytes
from batch_llm.stages import plan as plan_mod
from helpers import demo_config

SUMMARY = "Summarize the following report in three full paragraphs for a reader who has not seen it: "
YES_NO = "Answer with yes or no only, and no other word, to the question that follows this line: "


def _group(text: str) -> tuple[int, int]:
    return prefix_groups(prompt_bytes(text, None, None), HISTORY_LEVELS)  # type: ignore[return-value]


def test_recorded_lengths_give_the_mean_of_the_deepest_group_that_has_enough_rows(tmp_path):
    store = Location(str(tmp_path / "lengths"))
    assert LengthHistory.load(store) is None  # a first run: nothing recorded
    rec = LengthRecorder()
    long_a, long_b = SUMMARY + "a" * 600, SUMMARY + "b" * 600  # one head, two 512-byte groups
    for _ in range(MIN_ROWS):
        rec.add(_group(long_a), 300)
    rec.add(_group(long_b), 10)  # too few rows of its own: its head's mean stands for it
    rec.add(_group("short"), 99)  # under 64 bytes: no group, nothing recorded
    assert rec.write(store) is not None
    h = LengthHistory.load(store)
    assert h is not None and h.files == 1 and h.groups == 2
    assert h.estimate(_group(long_a), 512) == 300
    assert h.estimate(_group(long_b), 512) == 242  # (4 x 300 + 10) / 5, rounded up
    assert h.estimate(_group(long_a), 128) == 128  # never above the row's budget
    assert h.estimate(_group(YES_NO + "?"), 512) == 512  # a template never seen: its budget
    assert h.estimate(_group("short"), 512) == 512
    assert h.rows_estimated == 3


def test_the_store_keeps_the_newest_records_and_skips_a_broken_one(tmp_path, monkeypatch):
    store = Location(str(tmp_path / "lengths"))
    names = iter(f"20261207T0000{i:02d}" for i in range(10))
    monkeypatch.setattr("batch_llm.cache.lengths.time.strftime", lambda *a: next(names))
    for i in range(6):
        rec = LengthRecorder()
        for _ in range(MIN_ROWS):
            rec.add(_group(SUMMARY + "x" * 10), 100 * (i + 1))
        rec.write(store, keep=4)
    kept = sorted(p.name for p in store.path().iterdir())
    assert len(kept) == 4 and kept[0].startswith("20261207T000002")  # the two oldest deleted
    (store.path() / "20261207T000009-broken.json").write_text("{not json")
    (store.path() / "20261207T000008-other.json").write_text(json.dumps({"levels": [32], "groups": [[1, 2, 9, 9]]}))
    h = LengthHistory.load(store, read=3)  # the newest three: one broken (skipped), one of other levels (ignored)
    assert h is not None and h.files == 2
    assert h.estimate(_group(SUMMARY + "x" * 10), 1024) == 600  # the newest record alone was read


def _rows(n: int = 6) -> list[dict]:
    """Summaries of long bodies, yes/no questions with short ones: by prompt length the yes/no rows
    come first; by what the model generates, the summaries."""
    rows = []
    for i in range(n):
        rows.append({"id": f"s{i}", "prompt": SUMMARY + "report " * (40 + i)})
        rows.append({"id": f"y{i}", "prompt": YES_NO + f"is {i} even?"})
    return rows


class _TemplateEngine:
    """Generates as a model would for the two templates: a summary runs 200 tokens, a yes/no answer 2."""

    def generate(self, reqs):
        for r in reqs:
            long = "Summarize" in (r.prompt_text or "")
            yield GenResult(key=r.key, text="text" if long else "yes", finish_reason="stop",
                            prompt_tokens=len(r.prompt_token_ids), completion_tokens=200 if long else 2)

    def close(self):
        pass


@pytest.mark.parametrize("setting", [None, False])
def test_the_next_plan_puts_the_template_that_generates_longest_first(tmp_path, demo_model_dir, monkeypatch,
                                                                      setting):
    from batch_llm.stages.infer import runner

    monkeypatch.setattr(runner, "start_engine", lambda *a, **k: (_TemplateEngine(), EngineInfo(kind="t", version="0")))
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    cfg = demo_config(tmp_path, input__path=str(src), sharding__num_shards=1, sharding__length_history=setting,
                      sharding__group_prefixes=False,  # the two templates' order is the test's
                      sampling__max_tokens=256, cache__enabled=False)
    store = store_for(RunLayout.for_run(cfg, run_id="a", ds="2026-12-01").cache_root(cfg), cfg).path()
    feeds, orders = [], []
    for day in ("2026-12-01", "2026-12-02"):
        layout = RunLayout.for_run(cfg, run_id="a", ds=day)
        model = api.fetch(cfg, layout)
        plan = api.plan_shards(cfg, layout)
        feeds.append([r["id"] for r in iter_jsonl(Location(plan.shards[0].url).path())])
        orders.append((plan.order, plan.length_history))
        m = api.infer_shard(cfg, layout, model, plan.shards[0], say=lambda _: None)
        published = [r["id"] for r in iter_jsonl(Location(m.outputs).path())]
        assert published == [r["id"] for r in _rows()]  # input order, whatever the feed's
    by_length = [r["id"] for r in sorted(_rows(), key=lambda r: len(r["prompt"]))]
    if setting is False:  # the budget alone, and nothing recorded
        assert feeds == [by_length, by_length] and [o for o, _ in orders] == ["budget, length"] * 2
        assert not store.exists()
        return
    assert feeds[0] == by_length and orders[0] == ("budget, length", None)
    assert feeds[1] == [f"s{i}" for i in range(6)] + [f"y{i}" for i in range(6)]  # the long generations first
    order, history = orders[1]
    assert order == "history, length"
    assert history["files"] == 1 and history["rows_estimated"] == 12 and history["store"].endswith(store.name)
    # set by hand it makes another plan; unset, the key is as it was before the setting existed
    keys = {v: plan_mod.plan_input_key(cfg.with_overrides({"sharding.length_history": v}), Location(str(src)))
            for v in (None, True, False)}
    assert len(set(keys.values())) == 3
    assert "length_history" not in json.dumps(plan_mod.plan_settings(cfg.with_overrides({"sharding.length_history":
                                                                                          None})))


def test_length_history_in_input_order_is_refused_saying_why(tmp_path):
    with pytest.raises(ValueError, match=r"length_history: true orders rows .* sort_by_length: false"):
        demo_config(tmp_path, sharding__sort_by_length=False, sharding__length_history=True)
    cfg = demo_config(tmp_path, sharding__sort_by_length=False)
    assert not cfg.sharding.uses_length_history


def test_the_cache_maintenance_leaves_the_length_records_alone(tmp_path):
    from batch_llm.cache.results import maintain_all

    root = Location(str(tmp_path / "results"))
    rec = LengthRecorder()
    rec.add(_group(SUMMARY + "x"), 5)
    rec.write(root.child("lengths", "k"))
    assert maintain_all(root) == {}  # not a namespace: neither compacted nor expired
    assert len(list((tmp_path / "results" / "lengths" / "k").iterdir())) == 1
