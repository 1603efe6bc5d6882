"""The run report (one HTML file, embedded PNG plots) and the doctor's checks, on synthetic runs.

Synthetic runs are written with the storage helpers the stages use: shard outputs, plan shards, error files,
earlier published partitions for the score trend. The doctor's tests feed it metrics that should and should
not produce each finding.
"""
from __future__ import annotations

import base64
import json
import re
import sys
from collections import Counter

import pytest
from batch_llm.analysis.doctor import Finding, diagnose, format_findings
from batch_llm.analysis.report import write_run_report
from batch_llm.analysis.run_stats import PrefixStats, TokenStats, read_token_stats
from batch_llm.io.storage import Location, exists, read_json, write_jsonl
from batch_llm.manifests import EvaluateManifest, FilterSummary
from synthetic_runs import fetch_manifest, make_run, plan_manifest, run_summary, shard_manifest

SECTIONS = ("doctor", "outcomes", "throughput", "time", "timeline", "lengths", "filter", "scores", "shards", "config")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _images(page: str) -> list[bytes]:
    return [base64.b64decode(d) for d in re.findall(r'<img alt="[^"]*" src="data:image/png;base64,([^"]+)"', page)]


def _section(page: str, anchor: str) -> str:
    m = re.search(rf'<section id="{anchor}">(.*?)</section>', page, re.S)
    assert m, f"section {anchor} missing"
    return m.group(1)


# ------------------------------------------------------------------------------------------ report
@pytest.mark.parametrize("n_shards,size_bound", [(3, 350_000), (500, 450_000)])
def test_report_sections_images_and_size(tmp_path, n_shards, size_bound):
    summary, version, pipe = make_run(tmp_path, n_shards)
    url = write_run_report(summary, version, pipe, gpus=8)
    assert url == version.child("report.html").url
    path = Location(url).path()
    assert exists(path)
    page = path.read_text(encoding="utf-8")
    for anchor in SECTIONS:
        body = _section(page, anchor)
        assert "could not be rendered" not in body, (anchor, body[:500])
    images = _images(page)
    # outcomes, throughput, time, token lengths, filter hits, score trend (the timeline is SVG, below)
    assert len(images) == 6
    timeline = _section(page, "timeline")
    assert "Largest avoidable phase: <b>engine</b>" in timeline and "generation" in timeline
    _check_timeline_svg(timeline, min(n_shards, 40))
    assert all(img.startswith(PNG_MAGIC) for img in images)
    assert len(page.encode()) < size_bound, len(page.encode())
    assert "max_num_seqs" in _section(page, "config")            # the configuration, as YAML
    assert "dt=2026-12-02" in _section(page, "scores")          # the trend reaches the earlier partitions
    assert "ours" in _section(page, "filter") and "secret (2)" in _section(page, "filter")
    assert "of a sample" not in _section(page, "scores")         # every row with a reference was scored
    shards = _section(page, "shards")
    rows = shards.count("<tr>") - 1                              # minus the header row
    if n_shards == 3:
        assert rows == 3
        assert "p95" not in _section(page, "throughput")         # one bar per shard, no distribution table
        assert "p95" not in _section(page, "time") and "s engine start" in _section(page, "time")
    else:
        assert rows == 10 and "10 slowest of 500 shards" in shards
        assert "p95" in _section(page, "throughput")             # a distribution instead of 500 bars
        assert "p95" in _section(page, "time")


def _check_timeline_svg(section: str, shards_drawn: int) -> None:
    """The timeline is an inline SVG explored by hovering (each bar's ``<title>``: shard, phase, seconds), with no
    script (the report's Content-Security-Policy allows none) and its legend outside the chart."""
    svg = re.search(r"<svg class=\"chart timeline\".*?</svg>", section, re.S)
    assert svg, section[:1000]
    bars = re.findall(r"<rect [^>]*><title>shard (\d+) · (\w+): ([\d.,]+) s \(", svg.group(0))
    assert len({b[0] for b in bars}) == shards_drawn and {b[1] for b in bars} >= {"engine", "generation"}, bars[:5]
    assert "<script" not in section and " on" not in re.sub(r"<title>.*?</title>|<text.*?</text>", "", svg.group(0))
    legend = section[svg.end():]
    assert legend.startswith("<figcaption") and "generation" in legend.split("</figcaption>")[0]
    assert "generation" not in re.sub(r"<title>.*?</title>", "", svg.group(0))  # no legend drawn over the bars


@pytest.mark.parametrize("n_shards", [3, 500])
def test_report_without_matplotlib_has_tables_and_names_the_extra(tmp_path, monkeypatch, n_shards):
    """A base install (no ``report`` extra): the same sections, each with its numbers as a table and no plot,
    and one line naming the extra that adds the plots."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    summary, version, pipe = make_run(tmp_path, n_shards)
    page = Location(write_run_report(summary, version, pipe)).path().read_text(encoding="utf-8")
    assert not _images(page) and "<img" not in page
    assert "pip install &#39;batch-llm[report]&#39;" in page
    assert "No plots but the timeline: matplotlib is not installed" in page
    for anchor in SECTIONS:
        assert "could not be rendered" not in _section(page, anchor), anchor
    for anchor in ("outcomes", "throughput", "time", "timeline", "lengths", "filter", "scores", "shards"):
        assert "<table" in _section(page, anchor), anchor
    assert "published" in _section(page, "outcomes") and "inference errors" in _section(page, "outcomes")
    assert "p95" in _section(page, "lengths") and "secret (2)" in _section(page, "filter")
    assert "dt=2026-12-02" in _section(page, "scores")
    if n_shards == 3:  # one row per shard where the plot had one bar per shard
        assert _section(page, "throughput").count("<tr>") == 1 + 3
        assert _section(page, "time").count("<tr>") == 1 + 3 and "s engine start" in _section(page, "time")
    else:
        assert "p95" in _section(page, "throughput") and "p95" in _section(page, "time")
    monkeypatch.undo()  # matplotlib back: the plots, and no such line
    page = Location(write_run_report(summary, version, pipe)).path().read_text(encoding="utf-8")
    assert _images(page) and "No plots" not in page


def test_report_says_the_score_is_a_sample(tmp_path):
    summary, version, pipe = make_run(tmp_path, 3)
    summary.manifests.evaluate = summary.manifests.evaluate.model_copy(
        update={"num_samples": 2000, "rows_with_references": 1_000_000, "sample_seed": 7})
    page = Location(write_run_report(summary, version, pipe)).path().read_text(encoding="utf-8")
    assert "a sample: 2,000 of the 1,000,000 rows with a reference answer" in _section(page, "scores")
    assert "evaluate.sample_seed = 7" in _section(page, "scores")


def test_report_without_scores_filter_or_shards(tmp_path):
    summary, version, pipe = make_run(tmp_path, 2, earlier=())
    summary.manifests.evaluate = EvaluateManifest(skipped="no reference answers", metrics={})
    summary.manifests.filter.summary = FilterSummary(enabled=False, rows_scanned=12)
    summary.config["filter"]["enabled"] = False
    summary.manifests.infer = None
    page = Location(write_run_report(summary, version, pipe)).path().read_text()
    assert "could not be rendered" not in page
    assert "skipped: no reference answers" in _section(page, "scores")
    assert "filter was off" in _section(page, "filter")
    assert len(_images(page)) == 1                                # only rows by outcome is left to plot


def test_token_stats_stream_the_shard_outputs(tmp_path):
    summary, _, _ = make_run(tmp_path, 4, rows_per_shard=5)
    st = read_token_stats(summary)
    assert st.rows == st.rows_total == 20
    expect = Counter(r["prompt_tokens"] for s in summary.manifests.infer
                     for r in map(json.loads, open(s.outputs)))
    assert st.prompt == expect
    summary.manifests.plan.order = "budget, length"               # the plan's order, not the setting, tells
    sorted_pad = read_token_stats(summary, batch_size=2).padded_tokens
    summary.manifests.plan.order = "budget, prefix, length"       # grouped by prefix: batches cut as they come
    grouped_pad = read_token_stats(summary, batch_size=2).padded_tokens
    assert sorted_pad < grouped_pad == read_token_stats(summary, batch_size=2, sort_by_length=False).padded_tokens


def test_publish_writes_the_report_and_points_to_it(tmp_path):
    from batch_llm.api import publish
    from batch_llm.config import parse_config
    from batch_llm.layout import RunLayout
    from batch_llm.manifests import EvaluateManifest, FilterManifest, FilterSummary, PlanManifest

    cfg = parse_config({"name": "pub", "model": {"ref": "m"}, "input": {"path": str(tmp_path / "in.jsonl")},
                        "output": {"path": str(tmp_path / "out")}})
    layout = RunLayout.for_run(cfg, run_id="t1", ds="2026-12-03")
    plan_dir, filt_dir = layout.stage("plan"), layout.stage("filter")
    write_jsonl(plan_dir.child("records.jsonl").path(),
                [{"idx": 0, "id": "a", "reference": None, "record": {"id": "a", "prompt": "hi"}}])
    write_jsonl(plan_dir.child("errors.jsonl").path(), [])
    write_jsonl(filt_dir.child("outputs.jsonl").path(), [{"id": "a", "idx": 0, "output": "hello", "prompt_tokens": 5,
                                                          "completion_tokens": 2, "finish_reason": "stop"}])
    write_jsonl(filt_dir.child("errors.jsonl").path(), [])
    plan = PlanManifest(input=str(tmp_path / "in.jsonl"), format="jsonl", records=plan_dir.child("records.jsonl").url,
                        errors=plan_dir.child("errors.jsonl").url, rows_read=1, valid=1, invalid=0, shards=[],
                        has_references=False)
    filtered = FilterManifest(outputs=filt_dir.child("outputs.jsonl").url,
                              inference_errors=filt_dir.child("errors.jsonl").url, rows=1, inference_error_rows=0,
                              summary=FilterSummary(rows_scanned=1))
    m = publish(cfg, layout, plan, filtered, EvaluateManifest(skipped="no references"))
    assert m.report == Location(m.version).child("report.html").url
    assert exists(Location(m.report).path())
    assert read_json(layout.published.child("_CURRENT.json").path())["report"] == m.report
    assert read_json(Location(m.summary).path())["report"] == m.report


# ------------------------------------------------------------------------------------------ doctor
def shard(i=0, *, rows=1000, start=5.0, gen=100.0, seconds=None, errors=0, cached=0, unique=None, kind="vllm",
          settings=None, attempts=None, out_tps=500.0):
    # 8,000 blocks x 16 = 128k tokens: 320 sequences of the mean 400 tokens, just above max_num_seqs 256
    st = {"max_num_seqs": 256, "max_model_len": 4096, "gpu_memory_utilization": 0.9, "num_kv_blocks": 8000,
          "block_size": 16, "enable_prefix_caching": True, "kv_cache_dtype": "auto", "tensor_parallel_size": 1,
          "device": "cuda", **(settings or {})}
    return shard_manifest(i, metrics={"rows": rows, "ok": rows - errors, "errors": errors, "cached_rows": cached,
                                      "unique_prompts": rows - errors if unique is None else unique,
                                      "input_tokens": 300 * rows, "output_tokens": 100 * (rows - errors),
                                      "engine_start_seconds": start, "generate_seconds": gen,
                                      "seconds": seconds if seconds is not None else start + gen + 1,
                                      "output_tokens_per_second": out_tps},
                          engine={"kind": kind, "settings": st, "attempts": attempts or [{"ok": True}]})


def summary_of(shards, *, engine=None, sampling=None, sharding=None, invalid=0):
    valid = sum(s.metrics.rows for s in shards)
    return run_summary(config={"engine": {"kind": shards[0].engine.kind if shards else "vllm", "batch_size": 16,
                                          "dedupe_prompts": True, "gpu_memory_utilization": 0.9,
                                          "cpu_kv_cache_gib": 2.0, **(engine or {})},
                               "sampling": {"max_tokens": 256, "temperature": 0.0, "seed": 0, **(sampling or {})},
                               "sharding": {"sort_by_length": True, **(sharding or {})}},
                       plan=plan_manifest(rows_read=valid + invalid, valid=valid, invalid=invalid), infer=shards)


def tokens(prompts=(300,) * 100, completions=(100,) * 100, *, truncated=0, batch=16, padded=None, real=None,
           slots=None, used=None):
    t = TokenStats(prompt=Counter(prompts), completion=Counter(completions), rows=len(prompts),
                   rows_total=len(prompts), truncated=truncated, batch_size=batch)
    t.real_tokens = real if real is not None else sum(prompts)
    t.padded_tokens = padded if padded is not None else t.real_tokens
    t.decode_used = used if used is not None else sum(completions)
    t.decode_slots = slots if slots is not None else t.decode_used
    return t


@pytest.fixture(autouse=True)
def _no_pool_gpus(monkeypatch):
    monkeypatch.setenv("BATCH_LLM_GPUS", "")  # the pool's GPUs come from each test's gpus argument


def run_doctor(summary, gpus=None, tok=None, prefix=None, errors=None) -> list[Finding]:
    return diagnose(summary, gpus=gpus, tokens=tok or tokens(), prefix=prefix, errors=errors, read_files=False)


def checks(findings) -> set[str]:
    return {c for f in findings for c in f.check.split(",")}


def changes(findings) -> set[str]:
    return {f.change for f in findings}


def healthy(n=8):
    return [shard(i, rows=4096, start=60.0, gen=1200.0) for i in range(n)]


def test_a_healthy_run_has_no_findings():
    f = run_doctor(summary_of(healthy()), gpus=8)
    assert f == [], format_findings(f)
    assert format_findings(f).startswith("No findings")


def test_engine_transformers_where_vllm_could_run():
    s = [shard(i, rows=4096, start=20, gen=2000, kind="transformers",
               settings={"device": "cuda", "batch_size": 16}) for i in range(8)]
    f = run_doctor(summary_of(s), gpus=8)
    eng = [x for x in f if "engine" in x.check.split(",")]
    assert eng and eng[0].change == "engine.kind: vllm" and eng[0].severity == "warning"
    assert "32,768 rows" in eng[0].evidence
    assert "engine" not in checks(run_doctor(summary_of(healthy()), gpus=8))


def test_sglang_on_a_gpu_names_the_measured_vllm_ratio():
    on = [shard(i, rows=4096, start=89, gen=1200, kind="sglang", settings={"device": "cuda"}) for i in range(2)]
    [f] = [x for x in run_doctor(summary_of(on), gpus=2) if x.title.startswith("SGLang")]
    assert f.change == "engine.kind: vllm" and "1.15x" in f.evidence and "42 s against 89 s" in f.evidence
    cpu = [shard(i, rows=4096, start=89, gen=1200, kind="sglang", settings={"device": "cpu"}) for i in range(2)]
    assert not [x for x in run_doctor(summary_of(cpu), gpus=0) if x.title.startswith("SGLang")]


def test_batch_mode_static_batches_waste_decode_slots():
    s = [shard(i, rows=4096, start=20, gen=2000, kind="transformers", settings={"device": "cuda"}) for i in range(8)]
    wasteful = tokens(completions=(10,) * 90 + (250,) * 10, slots=25000, used=3400)
    f = run_doctor(summary_of(s), gpus=8, tok=wasteful)
    assert "batch_mode" in checks(f)
    assert "86% of decode slots" in next(x.evidence for x in f if "batch_mode" in x.check)
    even = tokens(slots=10000, used=9500)
    assert "batch_mode" not in checks(run_doctor(summary_of(s), gpus=8, tok=even))


def test_padding_from_prompt_length_spread():
    s = [shard(i, rows=4096, start=20, gen=2000, kind="transformers", settings={"device": "cuda"}) for i in range(8)]
    spread = tokens(prompts=(50,) * 80 + (900,) * 20, padded=60000, real=22000)
    f = run_doctor(summary_of(s, sharding={"sort_by_length": False}), gpus=8, tok=spread)
    pad = next(x for x in f if "padding" in x.check.split(","))
    assert pad.change == "sharding.sort_by_length: true" and "p50 50, p95 900" in pad.evidence
    f = run_doctor(summary_of(s, sharding={"group_prefixes": True}), gpus=8, tok=spread)  # grouped, not by length
    pad = next(x for x in f if "padding" in x.check.split(","))
    assert pad.change == "sharding.group_prefixes: false" and "grouped by prompt prefix" in pad.evidence
    f = run_doctor(summary_of(s), gpus=8, tok=spread)              # sorted already: smaller batches
    assert next(x for x in f if "padding" in x.check.split(",")).change == "engine.batch_size: 8"
    assert "padding" not in checks(run_doctor(summary_of(s), gpus=8, tok=tokens(padded=31000, real=30000)))
    assert "padding" not in checks(run_doctor(summary_of(healthy()), gpus=8, tok=spread))  # vLLM does not pad


def test_max_num_seqs_raised_when_the_kv_cache_has_room():
    s = [shard(i, rows=4096, start=60, gen=1200, settings={"num_kv_blocks": 200000}) for i in range(8)]
    f = run_doctor(summary_of(s), gpus=8)
    assert "engine.max_num_seqs: 1024" in changes(f)                 # 3.2M tokens / 400 = 8000 seqs, capped
    s = [shard(i, rows=4096, start=60, gen=1200, settings={"num_kv_blocks": 14000}) for i in range(8)]
    f = run_doctor(summary_of(s), gpus=8)
    assert "engine.max_num_seqs: 512" in changes(f)                  # 224k tokens / 400 = 560 seqs


def test_max_num_seqs_never_filled_by_small_shards():
    s = [shard(i, rows=40, start=60, gen=10) for i in range(100)]
    f = run_doctor(summary_of(s), gpus=4)
    sized = [x for x in f if {"max_num_seqs", "engine_start"} & set(x.check.split(","))]
    assert len(sized) == 1 and sized[0].change == "sharding.num_shards: 4"   # 4,000 rows: one shard per GPU
    assert set(sized[0].check.split(",")) == {"max_num_seqs", "engine_start"}  # both reasons, one change
    assert "max_num_seqs" not in checks(run_doctor(summary_of(healthy()), gpus=8))


def test_speculative_decoding_advised_only_where_it_was_measured_to_gain():
    """n-gram speculation gained at batch 1 and 32 on the H200, not at 256: advised for a GPU run that keeps few
    sequences in flight, never for a full batch, a CPU run, or a run that already speculates."""
    few = [shard(i, rows=16, start=60, gen=100) for i in range(2)]
    f = run_doctor(summary_of(few), gpus=2)
    (spec,) = [x for x in f if x.check == "speculative"]
    assert spec.change == "engine.speculative: {method: ngram, num_speculative_tokens: 4}"
    assert "16 sequences" in spec.evidence and "1.79x" in spec.evidence
    assert "speculative" not in checks(run_doctor(summary_of(healthy()), gpus=8))
    cpu = [shard(i, rows=16, start=60, gen=100, settings={"device": "cpu"}) for i in range(2)]
    assert "speculative" not in checks(run_doctor(summary_of(cpu), gpus=0))
    on = [shard(i, rows=16, start=60, gen=100, settings={"speculative_method": "ngram"}) for i in range(2)]
    assert "speculative" not in checks(run_doctor(summary_of(on), gpus=2))


def test_kv_cache_limits_concurrency_on_gpu():
    small = {"num_kv_blocks": 3000, "gpu_memory_utilization": 0.7}    # 48k tokens = 120 seqs of 400 < 256
    s = [shard(i, rows=4096, start=60, gen=1200, settings=small) for i in range(8)]
    f = run_doctor(summary_of(s, engine={"gpu_memory_utilization": 0.7}), gpus=8)
    assert {"engine.gpu_memory_utilization: 0.88", "engine.kv_cache_dtype: fp8"} <= changes(f)
    s = [shard(i, rows=4096, start=60, gen=1200, settings={"num_kv_blocks": 3000, "kv_cache_dtype": "fp8"})
         for i in range(8)]
    f = run_doctor(summary_of(s), gpus=8)
    assert "engine.max_num_seqs: 64" in changes(f) and "kv_dtype" not in checks(f)
    assert not checks(run_doctor(summary_of(healthy()), gpus=8)) & {"kv_cache", "kv_dtype", "memory"}


def test_kv_cache_on_cpu_asks_for_a_bigger_cpu_cache():
    s = [shard(i, rows=4096, start=60, gen=1200, settings={"num_kv_blocks": 3000, "device": "cpu"}) for i in range(8)]
    f = run_doctor(summary_of(s))
    assert "engine.cpu_kv_cache_gib: 5" in changes(f)               # 2 GiB x 256 / 120
    assert "kv_dtype" not in checks(f)                               # fp8 is a GPU matter


def test_memory_headroom_and_backoff():
    s = [shard(i, rows=4096, start=60, gen=1200, settings={"gpu_memory_utilization": 0.98}) for i in range(8)]
    f = run_doctor(summary_of(s, engine={"gpu_memory_utilization": 0.98}), gpus=8)
    assert "engine.gpu_memory_utilization: 0.88" in changes(f)
    tries = [{"gpu_memory_utilization": 0.9, "max_num_seqs": None, "error": "oom"},
             {"gpu_memory_utilization": 0.85, "max_num_seqs": 128, "ok": True}]
    s = [shard(i, rows=4096, start=60, gen=1200, attempts=tries) for i in range(8)]
    f = run_doctor(summary_of(s), gpus=8)
    mem = next(x for x in f if "memory" in x.check.split(","))
    assert mem.change == "engine.gpu_memory_utilization: 0.85, engine.max_num_seqs: 128"
    assert "8 of 8 shards needed 8 failed start(s)" in mem.evidence


def test_replicas_count_their_memory_shares_and_their_starts_are_not_back_offs():
    """engine.replicas: each engine records its own share and one start: two replicas of 0.49 hold 0.98 of the
    GPU, and two successful starts are no back-off; a replica's back-off is advised as the config's whole share."""
    two = {"gpu_memory_utilization": 0.49, "replicas": 2, "replicas_started": 2}
    s = [shard(i, rows=4096, start=60, gen=1200, settings=two, attempts=[{"ok": True}, {"ok": True}])
         for i in range(8)]
    f = run_doctor(summary_of(s, engine={"gpu_memory_utilization": 0.98}), gpus=8)
    assert "engine.gpu_memory_utilization: 0.88" in changes(f)
    assert not any("backed off" in x.title for x in f)
    tries = [{"gpu_memory_utilization": 0.45, "max_num_seqs": None, "error": "oom"},
             {"gpu_memory_utilization": 0.425, "max_num_seqs": 128, "ok": True}, {"ok": True}]
    s = [shard(i, rows=4096, start=60, gen=1200, settings={**two, "gpu_memory_utilization": 0.425}, attempts=tries)
         for i in range(8)]
    mem = next(x for x in run_doctor(summary_of(s), gpus=8) if "backed off" in x.title)
    assert mem.change == "engine.gpu_memory_utilization: 0.85, engine.max_num_seqs: 128"
    assert "8 of 8 shards needed 8 failed start(s)" in mem.evidence


def test_prefix_caching_off_while_prompts_share_a_system_prompt():
    s = [shard(i, rows=4096, start=60, gen=1200, settings={"enable_prefix_caching": False}) for i in range(8)]
    shared = PrefixStats(rows=200, common_prefix_chars=1200, system_share=1.0, system_chars=1200)
    f = run_doctor(summary_of(s), gpus=8, prefix=shared)
    assert "engine.enable_prefix_caching: true" in changes(f)
    assert "prefix_cache" not in checks(run_doctor(summary_of(s), gpus=8, prefix=PrefixStats(rows=200)))
    on = [shard(i, rows=4096, start=60, gen=1200) for i in range(8)]
    assert "prefix_cache" not in checks(run_doctor(summary_of(on), gpus=8, prefix=shared))


def test_engine_start_share_suggests_bigger_shards():
    s = [shard(i, rows=10000, start=60, gen=40) for i in range(100)]     # 0.004 s a row, start 59 %
    f = run_doctor(summary_of(s))
    st = next(x for x in f if "engine_start" in x.check.split(","))
    assert st.change == "sharding.rows_per_shard: 262144"            # >= 135,000 rows, rounded up
    assert "≥135,000 rows" in st.evidence and "the change gives 4 shards" in st.evidence
    f = run_doctor(summary_of(s), gpus=8)                            # 8 GPUs: one shard each at most
    assert next(x for x in f if "engine_start" in x.check.split(",")).change == "sharding.num_shards: 8"
    assert "engine_start" not in checks(run_doctor(summary_of(healthy()), gpus=8))


def test_shards_against_gpus():
    s = [shard(i, rows=4096, start=60, gen=1200) for i in range(3)]
    f = run_doctor(summary_of(s), gpus=8)
    assert next(x for x in f if "gpu_sharding" in x.check.split(",")).change == "sharding.num_shards: 8"
    s = [shard(i, rows=4096, start=60, gen=1200) for i in range(9)]
    assert "sharding.num_shards: 8" in changes(run_doctor(summary_of(s), gpus=8))
    assert "gpu_sharding" not in checks(run_doctor(summary_of(healthy(16)), gpus=8))
    assert "gpu_sharding" not in checks(run_doctor(summary_of(s)))   # pool unknown: no claim


def test_gpus_from_the_environment(monkeypatch):
    s = [shard(i, rows=4096, start=60, gen=1200) for i in range(3)]
    monkeypatch.setenv("BATCH_LLM_GPUS", "0,1,2,3")
    assert "sharding.num_shards: 4" in changes(run_doctor(summary_of(s)))


def test_error_rates():
    s = [shard(i, rows=4096, start=60, gen=1200, errors=(400 if i == 0 else 0)) for i in range(8)]
    errs = {"plan": Counter({"missing id": 500}), "infer": Counter({"prompt is N tokens; ...": 400}),
            "too_long": 400, "max_prompt_tokens": 7000}
    f = run_doctor(summary_of(s, invalid=500), gpus=8, errors=errs)
    by = {x.title: x for x in f}
    assert "engine.max_model_len: 8192" == by["rows failed in inference"].change   # 7000 + 256 -> 8192
    assert by["input rows rejected by the planner"].severity == "info"            # 500 of 33,268
    assert "missing id (500)" in by["input rows rejected by the planner"].evidence
    assert "errors" not in checks(run_doctor(summary_of(healthy()), gpus=8))


def test_truncation():
    f = run_doctor(summary_of(healthy()), gpus=8, tok=tokens(truncated=40))
    assert "sampling.max_tokens: 512" in changes(f)
    assert "truncation" not in checks(run_doctor(summary_of(healthy()), gpus=8, tok=tokens(truncated=5)))


def test_truncation_at_the_rows_own_max_tokens_reads_their_budgets(tmp_path):
    """Rows that set their own max_tokens (an OpenAI Batch request's, an input column) and stopped there: the
    doctor reads their budgets from the planned shard and does not advise sampling.max_tokens, which is only the
    default of rows that set none; rows stopped at that default still get it."""
    summary, _, _ = make_run(tmp_path, 1, rows_per_shard=12)
    shard_out = Location(summary.manifests.shards[0].outputs).path()
    plan_rows = Location(summary.manifests.plan.shards[0].url).path()
    budgets = [4 + 4 * i for i in range(12)]  # the requests ask 4-48 tokens; sampling.max_tokens is 256
    write_jsonl(shard_out, [{"id": f"q{i}", "idx": i, "output": "ok", "finish_reason": "length", "prompt_tokens": 30,
                             "completion_tokens": b, "cached": False, "error": None} for i, b in enumerate(budgets)])
    write_jsonl(plan_rows, [{"id": f"q{i}", "idx": i, "messages": [{"role": "user", "content": "q"}],
                             "params": {"max_tokens": b}} for i, b in enumerate(budgets)])
    tok = read_token_stats(summary)
    assert tok.truncated == 12 and tok.truncated_own == Counter(budgets)
    f = [x for x in run_doctor(summary, tok=tok) if x.check == "truncation"]
    assert len(f) == 1 and "(4–48 tokens)" in f[0].evidence
    assert "sampling.max_tokens:" not in f[0].change and "rows' own max_tokens" in f[0].change
    capped = summary.model_copy(update={"config": {**summary.config, "sampling": {"max_tokens": 256,
                                                                                   "max_tokens_cap": 48}}})
    assert any(c.startswith("sampling.max_tokens_cap: 96") for c in changes(run_doctor(capped, tok=tok)))
    write_jsonl(plan_rows, [{"id": f"q{i}", "idx": i, "messages": [{"role": "user", "content": "q"}]}
                            for i in range(12)])  # no row sets one: the pipeline's default stopped them
    tok = read_token_stats(summary)
    assert not tok.truncated_own and "sampling.max_tokens: 512" in changes(run_doctor(summary, tok=tok))


def test_cache_duplicates_and_random_sampling():
    s = [shard(i, rows=4096, start=60, gen=1200, unique=3000) for i in range(8)]
    f = run_doctor(summary_of(s, engine={"dedupe_prompts": False}), gpus=8)
    assert "engine.dedupe_prompts: true" in changes(f)
    assert "cache" not in checks(run_doctor(summary_of(s), gpus=8))  # folded already
    s = [shard(i, rows=4096, start=60, gen=1200, cached=500) for i in range(8)]
    f = run_doctor(summary_of(s, sampling={"temperature": 0.7, "seed": None}), gpus=8)
    assert "cache.enabled: false" in changes(f)
    assert "cache" not in checks(run_doctor(summary_of(s), gpus=8))  # greedy: a cache hit is the same answer


def test_format_findings():
    text = format_findings([Finding("warning", "t", "e 1", "engine.kind: vllm", "engine")])
    assert "[warning] t" in text and "change:   engine.kind: vllm" in text


def test_max_model_len_advice_is_bounded_by_the_model(demo_model_dir):
    """A 200k-token row on a model of 8,192 positions: no max_model_len helps, and the doctor says so instead
    of advising 262144; rows that fit get at most the model's limit."""
    s = [shard(i, rows=4096, start=60, gen=1200, errors=(400 if i == 0 else 0),
               settings={"model_context_limit": 8192}) for i in range(8)]

    def advice(longest, summary=None):
        errs = {"plan": Counter(), "infer": Counter({"prompt is N tokens; ...": 400}), "too_long": 400,
                "max_prompt_tokens": longest}
        f = run_doctor(summary or summary_of(s), gpus=8, errors=errs)
        return {x.title: x for x in f}["rows failed in inference"]

    huge = advice(200_000)
    assert "262144" not in huge.change and "max_model_len: " not in huge.change
    assert huge.change.startswith("input: split or shorten prompts to under 7,936 tokens")
    assert "cannot fit at all" in huge.evidence and "8,192" in huge.evidence
    assert advice(7000).change == "engine.max_model_len: 8192"                  # 7000 + 256 fits in 8192
    near = advice(8100)                                                          # fits, but not with 256 more
    assert near.change.startswith("engine.max_model_len: 8192") and "fewer than" in near.evidence
    # no limit recorded by the engine: the model folder the run names says it (config.json)
    old = [shard(i, rows=4096, start=60, gen=1200, errors=(400 if i == 0 else 0)) for i in range(8)]
    summary = summary_of(old)
    summary.manifests.fetch = fetch_manifest(str(demo_model_dir))
    assert advice(200_000, summary).change.startswith("input: split")
    assert advice(20_000, summary_of(old)).change == "engine.max_model_len: 32768"  # limit unknown: as before


def test_doctor_names_the_largest_avoidable_phase_of_the_timeline(tmp_path):
    summary, _, _ = make_run(tmp_path, 3)
    findings = [f for f in diagnose(summary, read_files=False) if "timeline" in f.check]
    assert len(findings) == 1 and findings[0].title == "largest avoidable phase: engine"
    assert "engine.compile_cache" in findings[0].change
    for s in summary.manifests.infer:  # on SGLang, its own settings: vLLM's compile keys are refused there
        s.engine.kind = "sglang"
    [sgl] = [f for f in diagnose(summary, read_files=False) if "timeline" in f.check]
    assert "engine.sglang.cuda_graph_max_bs" in sgl.change and "engine.compile_cache" not in sgl.change
    for s in summary.manifests.infer:
        s.engine.kind = "vllm"
    for s in summary.manifests.infer:  # engine start negligible: imports, the largest left, is 3 %
        for p in s.phases:
            if p.name == "engine":
                p.end = p.start + 0.5
    assert not [f for f in diagnose(summary, read_files=False) if "timeline" in f.check]
    for s in summary.manifests.infer:  # a late first result (the longest rows lead the shard) is generation
        first = next(p for p in s.phases if p.name == "first_token")
        gen = next(p for p in s.phases if p.name == "generation")
        first.end = gen.start = first.start + 0.5 * (gen.end - first.start)
    assert not [f for f in diagnose(summary, read_files=False) if "timeline" in f.check]


def test_run_values_are_escaped_and_only_the_reports_own_markup_is_markup():
    """The page is a jinja2 template with autoescape: a pipeline name, a model ref or a config value that holds
    HTML shows as text; the notes the report builds with markup (code, bold) keep it."""
    from batch_llm.analysis.report import render_report
    from batch_llm_airflow.report_app import render_index

    summary = run_summary(pipeline="<script>alert(1)</script>", partition="2026-01-01", run_id="r&1",
                          config={"model": {"ref": "org/<img src=x onerror=alert(2)>"}}, plan=plan_manifest())
    page = render_report(summary)
    assert "<script>alert(1)" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "<img src=x" not in page and "&lt;img src=x onerror=alert(2)&gt;" in page
    assert "<code>r&amp;1</code>" in page
    assert "font:14px/1.45 system-ui,-apple-system,'Segoe UI'" in page  # the stylesheet is included unescaped
    index = render_index([{"dag_id": "d<1", "partition": "p", "version": "v", "url": "s3://b/x.html", "conn_id": None}])
    assert "<td>d&lt;1</td>" in index and 'href="/batch-llm/report?path=s3%3A%2F%2Fb%2Fx.html"' in index


def test_the_report_names_the_order_of_the_rows_in_a_shard():
    """The plan manifest's order (sharding.sort_by_length, sharding.group_prefixes as resolved for the engine) is
    among the page's facts; a plan from before it names none and the fact is left out."""
    from batch_llm.analysis.report import render_report

    plan = plan_manifest()
    assert "order in a shard" not in render_report(run_summary(config={}, plan=plan))
    plan.order = "budget, prefix, length"
    page = render_report(run_summary(config={}, plan=plan))
    assert "order in a shard" in page and "budget, prefix, length" in page and "expected lengths" not in page
    plan.order = "history, prefix, length"  # read from earlier runs' records (sharding.length_history)
    plan.length_history = {"store": "s3://b/lengths/k", "files": 12, "groups": 3456, "rows_estimated": 98765}
    page = render_report(run_summary(config={}, plan=plan))
    assert ("history, prefix, length (expected lengths from 12 earlier shard records, 3,456 prompt groups; "
            "98,765 rows estimated)") in page


def test_score_trend_reads_only_the_newest_partitions_it_shows(tmp_path, monkeypatch):
    """A pipeline with many earlier partitions: the trend holds the newest ``limit - 1`` of them, oldest first,
    and checks no older partition's pointer (each check is a request on object storage)."""
    import batch_llm.analysis.report as report

    earlier = tuple(f"dt=2026-11-{d:02d}" for d in range(1, 13))
    summary, _, pipe = make_run(tmp_path, 2, earlier=earlier)
    checked = []
    real_exists = report.exists
    monkeypatch.setattr(report, "exists", lambda p: checked.append(p.parent.name) or real_exists(p))
    trend = report.score_history(summary, pipe, limit=4)
    assert [t["partition"] for t in trend] == ["dt=2026-11-10", "dt=2026-11-11", "dt=2026-11-12", summary.partition]
    assert trend[-1]["current"] and not any(t["current"] for t in trend[:-1])
    assert sorted(checked) == ["dt=2026-11-10", "dt=2026-11-11", "dt=2026-11-12"]


@pytest.mark.parametrize("n_shards", [1, 8, 300])
def test_no_chart_legend_covers_a_plot(tmp_path, n_shards):
    """Every chart of the report keeps its legend off the plotting areas: drawn, no legend's box overlaps any
    axes of its figure (the timeline's legend used to sit over the bars of shard 0). One shard, a few (bars and
    the timeline) and many (histograms and scatter plots)."""
    import batch_llm.analysis.report as report

    pytest.importorskip("matplotlib")
    figures = []
    draw = report._img

    def keep(fig, alt):
        figures.append((alt, fig))
        return draw(fig, alt)

    summary, version, pipe = make_run(tmp_path, n_shards)
    mp = pytest.MonkeyPatch()
    mp.setattr(report, "_img", keep)
    try:
        report.render_report(summary, pipeline_root=pipe)
    finally:
        mp.undo()
    legends = 0
    for alt, fig in figures:
        renderer = fig.canvas.get_renderer()
        boxes = [ax.get_window_extent(renderer) for ax in fig.axes]
        for legend in [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend())]:
            legends += 1
            box = legend.get_window_extent(renderer)
            assert not [b for b in boxes if b.overlaps(box)], (alt, box, boxes)
            assert 0 <= box.x0 and box.x1 <= fig.bbox.width and 0 <= box.y0 and box.y1 <= fig.bbox.height, (alt, box)
    assert legends >= 4, [alt for alt, _ in figures]  # the charts with a legend were drawn


def test_quantile_is_the_nearest_rank_of_the_counted_values():
    """quantile (numpy's weighted inverted CDF) gives the value at rank ceil(q * total) of the counted values."""
    from batch_llm.analysis.run_stats import quantile

    four = {4: 1, 1: 1, 3: 1, 2: 1}
    assert [quantile(four, q) for q in (0, 0.25, 0.5, 0.51, 0.75, 0.76, 1)] == [1, 1, 2, 3, 3, 4, 4]
    assert quantile({10: 99, 500: 1}, 0.99) == 10 and quantile({10: 99, 500: 1}, 0.991) == 500
    assert quantile({5: 0, 7: 2}, 0) == 7 and quantile({}, 0.5) is None and quantile({3: 0}, 0.5) is None
