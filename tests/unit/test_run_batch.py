"""``batch-llm run-batch`` (include/batch_llm/frontends/run_batch.py): vLLM's ``vllm run-batch`` flags onto one pipeline,
no YAML: each flag's key, vLLM's sampling defaults for a request that sets none, and the output in input order.
No engine."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from batch_llm.config import ConfigError
from batch_llm.frontends import run_batch as rb
from batch_llm.frontends.cli import build_parser


def _model(tmp_path: Path, **generation) -> Path:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    if generation:
        (model / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, **generation}))
    return model


def _args(*words: str):
    return build_parser().parse_args(["run-batch", *words])


def test_vllm_run_batch_flags_set_their_keys(tmp_path):
    model = _model(tmp_path)
    args = _args("-i", "in.jsonl", "-o", "out.jsonl", "--model", str(model), "--max_model_len", "512",
                 "--dtype", "float32", "--enforce-eager", "--seed", "3", "-tp", "1", "--max-num-seqs", "8",
                 "--gpu-memory-utilization", "0.8", "--no-enable-prefix-caching", "--max-num-batched-tokens", "4096",
                 "--kv-cache-dtype", "fp8", "--trust-remote-code", "--served-model-name", "smol")
    cfg, warnings = rb.build_config(args, tmp_path / "work", keep=False)
    e = cfg.engine
    assert (e.max_model_len, e.dtype, e.enforce_eager, e.tensor_parallel_size, e.max_num_seqs) == (
        512, "float32", True, 1, 8)
    assert (e.gpu_memory_utilization, e.enable_prefix_caching, e.kv_cache_dtype) == (0.8, False, "fp8")
    assert e.extra == {"max_num_batched_tokens": 4096} and e.max_error_rate == 1.0
    assert cfg.model.ref == str(model) and cfg.model.trust_remote_code
    assert cfg.input.format == "openai_batch" and cfg.input.path == "in.jsonl"
    assert not cfg.filter.enabled and not cfg.evaluate.enabled and not cfg.cache.enabled
    assert cfg.sharding.num_shards == 1 and warnings == []
    # a request that sets nothing: vLLM's defaults (temperature 1, the rest of the context), the given seed
    assert (cfg.sampling.temperature, cfg.sampling.max_tokens, cfg.sampling.seed) == (1.0, 512, 3)


def test_the_models_generation_config_gives_the_defaults_as_vllm_auto_does(tmp_path):
    model = _model(tmp_path, temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=1.05, max_new_tokens=100,
                   presence_penalty=0.5)
    words = ["-i", "in.jsonl", "-o", "o.jsonl", "--model", str(model), "--max-model-len", "512"]
    cfg, warnings = rb.build_config(_args(*words), tmp_path / "w", keep=False)
    s = cfg.sampling
    assert (s.temperature, s.top_p, s.top_k, s.repetition_penalty, s.max_tokens) == (0.6, 0.9, 20, 1.05, 100)
    assert warnings == ["--generation-config auto: presence_penalty 0.5 is not a default here; requests set it in "
                        "their body"]
    cfg, _ = rb.build_config(_args(*words, "--generation-config", "vllm"), tmp_path / "w", keep=False)
    assert (cfg.sampling.temperature, cfg.sampling.top_k, cfg.sampling.max_tokens) == (1.0, 0, 512)


def test_chat_template_file_and_refusals(tmp_path, capsys):
    model = _model(tmp_path)
    tpl = tmp_path / "t.jinja"
    tpl.write_text("{{ messages[0]['content'] }}")
    cfg, _ = rb.build_config(_args("-i", "i", "-o", "o", "--model", str(model), "--chat-template", str(tpl)),
                             tmp_path / "w", keep=True)
    assert cfg.model.chat_template == "{{ messages[0]['content'] }}" and cfg.cache.enabled  # a kept work folder
    with pytest.raises(ConfigError, match="--tokenizer other: the model's own tokenizer"):
        rb.build_config(_args("-i", "i", "-o", "o", "--model", str(model), "--tokenizer", "other"), tmp_path / "w",
                        keep=False)
    with pytest.raises(SystemExit):
        _args("-i", "i", "-o", "o", "--model", "m", "--swap-space", "4")
    assert "unrecognized arguments: --swap-space 4" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _args("-i", "i", "--model", "m")
    assert "required: -o/--output-file" in capsys.readouterr().err


def test_output_lines_follow_the_input_order_with_refusals_among_them(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"custom_id": "a"}\nnot json\n{"custom_id": 7}\n{"custom_id": "b"}\n')

    def line(cid, status):
        return {"custom_id": cid, "response": {"status_code": status}}

    done = {"a": [line("a", 200)], "b": [line("b", 200)]}
    refused = {"7": [line("7", 400)], None: [line(None, 400)]}
    got = list(rb.in_input_order([src], done, refused))
    assert [(x["custom_id"], x["response"]["status_code"]) for x in got] == [("a", 200), (None, 400), ("7", 400),
                                                                            ("b", 200)]


def test_every_flag_is_documented():
    text = (Path(__file__).resolve().parents[2] / "docs" / "user-guide.md").read_text(encoding="utf-8")
    for f in rb.FLAGS:
        assert f"`{f.names[-1]}`" in text, f.names[-1]


def test_a_line_that_is_not_utf8_json_text_is_answered_once_in_its_place(tmp_path):
    """A lone surrogate (``\\ud800`` escaped) or raw bytes that are not UTF-8: the line's answer is an error line
    carrying its custom_id where that still reads cleanly (else none, its line number in the message), and every
    line is answered exactly once, in input order, with the planner's own reading of each line."""
    from batch_llm.io.storage import Location, iter_jsonl
    from batch_llm.rows.records import openai_error_line, output_record
    from batch_llm.stages import plan as plan_mod
    from helpers import demo_config

    def request(cid: str, content: str) -> bytes:
        return ('{"custom_id": "%s", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": '
                '[{"role": "user", "content": "%s"}]}}\n' % (cid, content)).encode()

    src = tmp_path / "requests.jsonl"
    src.write_bytes(request("a", "hi") + request("s", "\\ud800") + request("r", "hi").replace(b"hi", b"\xff\xfe")
                    + request("\\udc00x", "hi") + b"\n" + request("b", "hi"))
    cfg = demo_config(tmp_path, input__path=str(src))
    m = plan_mod.write_plan(cfg, input_loc=Location(str(src)), plan_dir=Location(str(tmp_path / "plan")))
    assert (m.valid, m.invalid) == (2, 3)
    done: dict = {}
    for rec in iter_jsonl(Location(m.records).path()):
        out = output_record(rec["record"], {"id": rec["id"], "idx": rec["idx"], "output": "ok", "finish_reason": "stop",
                                            "prompt_tokens": 1, "completion_tokens": 1}, "openai_batch")
        done.setdefault(rb._key(out["custom_id"]), []).append(out)
    refused: dict = {}
    for e in iter_jsonl(Location(m.errors).path()):  # as the published error file carries them
        where = f"{e['source']} line {e['line']}"
        line = openai_error_line(e["id"], f"{e['reason']} ({where})", code="invalid_request", run_id="r", where=where)
        refused.setdefault(rb._key(line["custom_id"]), []).append(line)
    got = list(rb.in_input_order([src], done, refused))
    assert [(x["custom_id"], x["response"]["status_code"]) for x in got] == [
        ("a", 200), ("s", 400), ("r", 400), (None, 400), ("b", 200)]
    messages = [x["response"]["body"].get("error", {}).get("message", "") for x in got]
    assert "lone UTF-16 surrogate" in messages[1] and "not valid UTF-8" in messages[2]
    assert "requests.jsonl line 4" in messages[3]


def test_the_report_outlives_the_temporary_work_folder(tmp_path):
    """Without --work-dir the run's folder is removed at the end: its report is copied beside -o first
    (results.jsonl -> results.report.html), so the path printed still opens after the command."""
    from batch_llm.frontends.written_config import keep_work_folder
    from batch_llm.io.storage import Location, write_json

    work = tmp_path / "work"
    out = tmp_path / "answers" / "results.jsonl"
    out.parent.mkdir()
    cfg, _ = rb.build_config(_args("-i", str(tmp_path / "in.jsonl"), "-o", str(out), "--model", str(_model(tmp_path)),
                                   "--generation-config", "vllm"), work, keep=False)
    part = Location(cfg.output.path).child(cfg.name, cfg.output.partition.format(ds="2026-12-06"))
    version = part.child("v-1")
    Path(version.path()).mkdir(parents=True)
    Path(version.child("report.html").path()).write_text("<html>the run</html>")
    write_json(part.child("_CURRENT.json").path(), {"version": version.url})
    kept = rb.keep_report(cfg, "2026-12-06", str(out))
    keep_work_folder(work, keep=False, started=True, finished=True)
    assert not work.exists()
    assert kept == out.parent / "results.report.html" and kept.read_text() == "<html>the run</html>"


# ------------------------------------------------------------------ output line ids and stop_reason, a whole run
class _StopEngine:
    """Answers as vLLM's offline engine does for each request's stop settings: a stop string ends it (stop_reason
    the string), else a stop token id (the id), else the length (no stop_reason)."""

    def generate(self, reqs):
        from batch_llm.engines.base import GenResult

        for r in reqs:
            p = r.params
            stop = (p.stop or [None])[0] if p and p.stop else (p.stop_token_ids or [None])[0] if p else None
            yield GenResult(key=r.key, text="ok", finish_reason="stop" if stop is not None else "length",
                            stop_reason=stop, prompt_tokens=len(r.prompt_token_ids), completion_tokens=1)

    def close(self):
        pass


def _published_lines(tmp_path: Path, out: str, run_id: str, monkeypatch) -> list[dict]:
    from batch_llm import api
    from batch_llm.engines.base import EngineInfo
    from batch_llm.layout import RunLayout
    from batch_llm.stages.infer import runner
    from helpers import demo_config

    monkeypatch.setattr(runner, "start_engine", lambda *a, **k: (_StopEngine(), EngineInfo(kind="stub", version="0")))
    cfg = demo_config(tmp_path, input__path=str(tmp_path / "requests.jsonl"), input__format="openai_batch",
                      output__path=str(tmp_path / out), sharding__num_shards=1, filter__enabled=False,
                      evaluate__enabled=False, engine__max_error_rate=1.0, cache__enabled=False)
    layout = RunLayout.for_run(cfg, run_id=run_id, ds="2026-12-06")
    model, plan = api.fetch(cfg, layout), api.plan_shards(cfg, layout)
    shards = [api.infer_shard(cfg, layout, model, s, say=lambda _: None) for s in plan.shards]
    filtered = api.content_filter(cfg, layout, plan, shards)
    api.publish(cfg, layout, plan, filtered, api.evaluate(cfg, layout, plan, filtered))
    n, _ = rb.write_output(str(tmp_path / out / "o.jsonl"), cfg, "2026-12-06", served_model_name="m")
    lines = [json.loads(x) for x in (tmp_path / out / "o.jsonl").read_text().splitlines()]
    assert len(lines) == n
    return lines


def test_output_ids_are_unique_per_request_and_stable_within_a_run_and_stop_reason_says_what_stopped(
        tmp_path, demo_model_dir, monkeypatch):
    """Each output and error line's ``id`` (and ``request_id``) is unique per request, as OpenAI's are, even where
    custom_ids repeat; a run published again under the same run id writes the same ids (a retry adds no new
    ones), another run other ones. ``stop_reason`` is vLLM's: the stop string or stop token id that ended the
    answer, null where the length did."""
    def request(cid, **body):
        return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                           "body": {"messages": [{"role": "user", "content": f"hi {cid}"}], **body}}) + "\n"

    (tmp_path / "requests.jsonl").write_text(request("s", stop=["###"]) + request("t", stop_token_ids=[2]) +
                                             request("n") + "not json\n" + request("s"))
    first = _published_lines(tmp_path, "a", "run-1", monkeypatch)
    assert [(x["custom_id"], x["response"]["status_code"]) for x in first] == [
        ("s", 200), ("t", 200), ("n", 200), (None, 400), ("s", 400)]  # the repeated custom_id: refused
    ids = [x["id"] for x in first]
    assert all(i.startswith("batch_req_") and len(i) == len("batch_req_") + 24 for i in ids)
    assert len(set(ids)) == len(ids) and len({x["response"]["request_id"] for x in first}) == len(ids)
    choices = [x["response"]["body"]["choices"][0] for x in first[:3]]
    assert [(c["finish_reason"], c["stop_reason"]) for c in choices] == [("stop", "###"), ("stop", 2),
                                                                         ("length", None)]
    again = _published_lines(tmp_path, "b", "run-1", monkeypatch)
    assert [x["id"] for x in again] == ids
    from batch_llm.rows.records import openai_line_ids

    assert openai_line_ids("run-1", "row 0")[0] in ids and openai_line_ids("run-2", "row 0")[0] not in ids


def test_the_pooling_runner_makes_an_embedding_pipeline_without_sampling_defaults(tmp_path):
    """vLLM's --runner pooling / --convert embed: engine.task embed (/v1/embeddings lines); the model's
    generation_config.json gives no defaults to a vector (top_k would be refused for embed), --seed does nothing."""
    model = _model(tmp_path, top_k=20, temperature=0.6)
    words = ["-i", "in.jsonl", "-o", "o.jsonl", "--model", str(model)]
    for extra in (["--runner", "pooling"], ["--convert", "embed"], ["--runner", "pooling", "--convert", "auto"]):
        cfg, warnings = rb.build_config(_args(*words, *extra, "--seed", "3"), tmp_path / "w", keep=False)
        assert cfg.engine.task == "embed" and cfg.sampling.top_k == 0 and cfg.sampling.seed == 0, extra
        assert warnings == ["--seed: no effect on embeddings"]
    cfg, _ = rb.build_config(_args(*words, "--runner", "generate"), tmp_path / "w", keep=False)
    assert cfg.engine.task == "generate" and cfg.sampling.top_k == 20
    with pytest.raises(ConfigError, match="--convert classify: class probabilities have no OpenAI Batch endpoint"):
        rb.build_config(_args(*words, "--convert", "classify"), tmp_path / "w", keep=False)
    with pytest.raises(ConfigError, match="--convert embed runs on the pooling runner"):
        rb.build_config(_args(*words, "--convert", "embed", "--runner", "generate"), tmp_path / "w", keep=False)
