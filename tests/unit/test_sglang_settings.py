"""engine.kind: sglang without SGLang: its config (engine.sglang, the keys it refuses), its capability row (per-row
refusals naming who can), the swift flags, the arguments of ``sglang.Engine`` and of each request, and how the
engine sorts SGLang's failures into error rows, a failed shard, or a memory failure the back-off retries. SGLang's
exception types and messages are its own (SGLang 0.5.17 source, file cited at each); fastapi's HTTPException is the
real one (SGLang raises it for a request its scheduler aborted with a 5xx status)."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys
import types

import pytest
from batch_llm.config import ConfigError, EngineConfig, SamplingConfig
from batch_llm.config.capabilities import capabilities
from batch_llm.config.sglang import SglangSettings
from batch_llm.engines.base import EngineFailed, EngineStartError, GenRequest
from batch_llm.engines.sglang_config import (
    deterministic_inference,
    row_json_schema,
    sampling_params,
    seeded_sampling_refusal,
    sglang_engine_args,
    sglang_request_refusal,
)
from batch_llm.engines.sglang_engine import SglangEngine, classify_sglang_start_failure, gen_result
from batch_llm.frontends import swift as sa
from batch_llm.rows.params import RowParams, Sampling, engine_refusal, resolve
from helpers import demo_config

# SGLang 0.5.17's ServerArgs fields (python/sglang/srt/server_args.py) that the engine section can set, and its
# SamplingParams fields (python/sglang/srt/sampling/sampling_params.py): an argument named otherwise would fail the
# engine's start (ServerArgs is a dataclass) or be refused per request.
SERVER_ARGS_0517 = frozenset({
    "model_path", "tokenizer_path", "context_length", "max_running_requests", "mem_fraction_static", "tp_size",
    "dtype", "quantization", "kv_cache_dtype", "disable_cuda_graph", "disable_radix_cache", "random_seed",
    "trust_remote_code", "max_total_tokens", "chunked_prefill_size", "enable_deterministic_inference",
    "cuda_graph_max_bs_decode", "enable_lora", "lora_paths", "max_lora_rank", "max_loras_per_batch", "device",
    "attention_backend", "sampling_backend", "custom_sigquit_handler", "ep_size", "disable_custom_all_reduce",
    "speculative_algorithm", "speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens",
    "log_level"})
SAMPLING_PARAMS_0517 = frozenset({
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex",
    "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "stream_interval", "logit_bias", "sampling_seed", "custom_params"})


def _engine(**kw) -> EngineConfig:
    return EngineConfig(kind="sglang", **kw)


# ------------------------------------------------------------------------------------------ config
def test_the_sglang_section_is_sglangs_and_refused_for_another_engine(tmp_path):
    cfg = demo_config(tmp_path, engine__kind="sglang", engine__sglang={"cuda_graph_max_bs": 128,
                                                                        "max_total_tokens": 200_000})
    assert cfg.engine.sglang == SglangSettings(cuda_graph_max_bs=128, max_total_tokens=200_000)
    with pytest.raises(ConfigError, match=r"engine.sglang: settings of engine.kind: sglang; engine.kind is 'vllm' "
                                          r"\(remove engine.sglang or set engine.kind: sglang\)"):
        demo_config(tmp_path, engine__sglang={"cuda_graph_max_bs": 128})
    with pytest.raises(ConfigError, match=r"engine.sglang.cuda_graph_max_bs"):
        demo_config(tmp_path, engine__kind="sglang", engine__sglang={"cuda_graph_max_bs": 0})
    with pytest.raises(ConfigError, match=r"unknown key 'max_batch_size'"):
        demo_config(tmp_path, engine__kind="sglang", engine__sglang={"max_batch_size": 128})


@pytest.mark.parametrize("key, value, said", [
    ("extra", {"mem_fraction_static": 0.8}, "engine.extra.mem_fraction_static: set engine.gpu_memory_utilization "
                                            "instead"),
    ("extra", {"cuda_graph_max_bs": 64}, "engine.extra.cuda_graph_max_bs: set engine.sglang.cuda_graph_max_bs"),
    ("extra", {"max_running_requests": 64}, "engine.extra.max_running_requests: set engine.max_num_seqs"),
    ("extra", {"lora_paths": ["a"]}, "engine.extra.lora_paths: set model.lora"),
    ("extra", {"skip_tokenizer_init": True}, "engine.extra.skip_tokenizer_init: the engine needs SGLang's "
                                             "detokenized text"),
    ("batch_size", 4, "engine.batch_size: only the transformers engine reads it"),
    ("cpu_kv_cache_gib", 4, "engine.cpu_kv_cache_gib: only vLLM's CPU backend reads it"),
    ("cuda_graphs", "vllm", "engine.cuda_graphs: vLLM's graph sets"),
    ("dtype", "fp8", "engine.dtype: 'fp8' is not an SGLang dtype"),
    ("speculative", {"num_speculative_tokens": 4}, "engine.speculative: n-gram speculative decoding is a vLLM "
                                                    "option"),
    ("torch_compile", True, "engine.torch_compile"),
    ("task", "embed", "task: embed runs on vLLM's pooling runner; engine.kind is 'sglang'"),
])
def test_keys_sglang_would_not_honour_are_refused_naming_them(key, value, said, tmp_path):
    with pytest.raises(ConfigError) as e:
        demo_config(tmp_path, engine__kind="sglang", **{f"engine__{key}": value})
    assert said in str(e.value)


def test_what_sglang_serves_and_what_it_refuses_per_row(tmp_path):
    caps = capabilities("sglang")
    assert caps.guided_decoding and caps.samples_and_logprobs and caps.penalties and caps.lora_served
    assert caps.tensor_parallel and not caps.speculative and not caps.pooling_tasks and not caps.memory_probe
    every = RowParams(n=2, logprobs=1, presence_penalty=0.5, top_k=5, min_p=0.1, include_stop_str_in_output=True,
                      response_format=json.dumps({"type": "json_object"}), stop_token_ids=(7,))
    assert engine_refusal(every, "sglang") is None
    # an engine without guided decoding names sglang among those that can
    assert engine_refusal(RowParams(response_format=json.dumps({"type": "json_object"})), "lmdeploy") == (
        "engine lmdeploy cannot apply per-row response_format (vllm and sglang can)")
    # pipeline-wide too: n, logprobs, an output schema and a served adapter pass config validation
    demo_config(tmp_path, engine__kind="sglang", sampling__n=2, sampling__logprobs=2,
                sampling__output_schema={"type": "object"})


# ------------------------------------------------------------------------------------------ swift flags
def test_swift_infer_backend_sglang_and_its_flags_map_onto_the_config(tmp_path):
    plan = sa.plan_invocation(sa.parse_swift_args([
        "--model", "m", "--val_dataset", "rows.jsonl", "--result_path", "out.jsonl", "--infer_backend", "sglang",
        "--sglang_tp_size", "2", "--sglang_mem_fraction_static", "0.85", "--sglang_context_length", "8192",
        "--sglang_disable_cuda_graph", "true", "--sglang_kv_cache_dtype", "fp8_e5m2", "--sglang_ep_size", "2",
        "--sglang_speculative_algorithm", "NGRAM", "--sglang_speculative_num_draft_tokens", "8",
        "--sglang_pp_size", "1", "--vllm_max_num_seqs", "64"]))
    over = plan.overrides
    assert over["engine.kind"] == "sglang"
    assert (over["engine.tensor_parallel_size"], over["engine.gpu_memory_utilization"],
            over["engine.max_model_len"], over["engine.enforce_eager"], over["engine.kv_cache_dtype"]) == (
        2, 0.85, 8192, True, "fp8_e5m2")
    assert (over["engine.extra.ep_size"], over["engine.extra.speculative_algorithm"],
            over["engine.extra.speculative_num_draft_tokens"]) == (2, "NGRAM", 8)
    assert "engine.max_num_seqs" not in over and any("--vllm_max_num_seqs: ignored" in w for w in plan.warnings)
    cfg = sa.build_config(plan, tmp_path)
    assert (cfg.engine.kind, cfg.engine.tensor_parallel_size, cfg.engine.extra["ep_size"]) == ("sglang", 2, 2)
    args = sglang_engine_args(cfg.engine, "/m", seed=0, trust_remote_code=False, dtype="auto", deterministic=False)
    assert (args["tp_size"], args["mem_fraction_static"], args["context_length"], args["disable_cuda_graph"],
            args["speculative_algorithm"]) == (2, 0.85, 8192, True, "NGRAM")
    for refused, value in (("--sglang_dp_size", "2"), ("--sglang_enable_dp_attention", "true"),
                           ("--sglang_enable_ep_moe", "true")):
        with pytest.raises(ConfigError, match=f"{refused} "):
            sa.plan_invocation(sa.parse_swift_args(["--model", "m", "--val_dataset", "r.jsonl", "--result_path",
                                                    "o.jsonl", "--infer_backend", "sglang", refused, value]))


# ------------------------------------------------------------------------------------------ engine arguments
def test_every_engine_key_reaches_its_sglang_argument():
    cfg = _engine(max_model_len=4096, max_num_seqs=128, gpu_memory_utilization=0.8, tensor_parallel_size=2,
                  dtype="bfloat16", quantization="fp8", kv_cache_dtype="fp8_e4m3", enforce_eager=True,
                  enable_prefix_caching=False, extra={"schedule_policy": "lpm", "log_level": "warning"},
                  sglang={"cuda_graph_max_bs": 160, "max_total_tokens": 100_000, "chunked_prefill_size": 4096})
    args = sglang_engine_args(cfg, "/models/q", seed=7, trust_remote_code=True, dtype="bfloat16",
                              deterministic=True, fields=SERVER_ARGS_0517, lora=("/adapters/a", 16))
    assert args == dict(model_path="/models/q", tokenizer_path="/models/q", context_length=4096,
                        max_running_requests=128, mem_fraction_static=0.8, tp_size=2, dtype="bfloat16",
                        quantization="fp8", kv_cache_dtype="fp8_e4m3", disable_cuda_graph=True,
                        disable_radix_cache=True, random_seed=7, trust_remote_code=True, max_total_tokens=100_000,
                        chunked_prefill_size=4096, enable_deterministic_inference=True, cuda_graph_max_bs_decode=160,
                        enable_lora=True, lora_paths={"model.lora": "/adapters/a"}, max_lora_rank=16,
                        max_loras_per_batch=1, schedule_policy="lpm", log_level="warning")
    assert set(args) - {"schedule_policy"} <= SERVER_ARGS_0517


def test_unset_keys_leave_sglang_its_own_choice_and_a_cpu_gets_portable_kernels():
    args = sglang_engine_args(_engine(), "/m", seed=None, trust_remote_code=False, dtype="auto", deterministic=False,
                              fields=SERVER_ARGS_0517 - {"cuda_graph_max_bs_decode"} | {"cuda_graph_max_bs"},
                              on_gpu=False)
    for sglangs_own in ("max_running_requests", "max_total_tokens", "chunked_prefill_size", "random_seed",
                        "quantization", "cuda_graph_max_bs", "cuda_graph_max_bs_decode", "enable_lora"):
        assert sglangs_own not in args, sglangs_own
    assert args["disable_radix_cache"] is False and args["disable_cuda_graph"] is False
    assert (args["device"], args["attention_backend"], args["sampling_backend"]) == ("cpu", "torch_native", "pytorch")
    # an SGLang before 0.5.17 names the graph ceiling cuda_graph_max_bs
    older = sglang_engine_args(_engine(sglang={"cuda_graph_max_bs": 64}), "/m", seed=None, trust_remote_code=False,
                               dtype="auto", deterministic=False, fields=frozenset({"cuda_graph_max_bs"}))
    assert older["cuda_graph_max_bs"] == 64 and "cuda_graph_max_bs_decode" not in older



def test_the_engines_constructor_args_are_what_a_plain_script_gets(tmp_path):
    """SglangEngine.constructor_args: the engine section's arguments (bench/inference.py's plain sglang.Engine script
    passes these, so the stage and the script start alike), deterministic inference resolved from the sampling."""
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"], "torch_dtype": "bfloat16"}))
    eng = SglangEngine(str(tmp_path), _engine(max_model_len=2048, sglang={"cuda_graph_max_bs": 512},
                                              extra={"load_format": "dummy"}),
                       SamplingConfig(temperature=0.7, seed=3))
    args = eng.constructor_args(SERVER_ARGS_0517, on_gpu=True)
    assert eng.deterministic
    assert args == sglang_engine_args(eng.cfg, str(tmp_path), seed=3, trust_remote_code=False, dtype="auto",
                                      deterministic=True, fields=SERVER_ARGS_0517)
    assert (args["cuda_graph_max_bs_decode"], args["context_length"], args["load_format"]) == (512, 2048, "dummy")
    assert "custom_sigquit_handler" not in args
    with pytest.raises(ValueError, match="engine.batch_size"):
        SglangEngine(str(tmp_path), _engine(batch_size=8), SamplingConfig()).constructor_args(None, on_gpu=True)


# ------------------------------------------------------------------------------------------ requests
def _sampling(**kw) -> Sampling:
    base = dict(max_tokens=32, temperature=0.0, top_p=1.0, stop=(), seed=None)
    return Sampling(**{**base, **kw})


def test_every_sampling_field_reaches_sglangs_sampling_params():
    plain = sampling_params(_sampling())
    assert plain == dict(max_new_tokens=32, temperature=0.0, top_p=1.0, top_k=-1, min_p=0.0, presence_penalty=0.0,
                         frequency_penalty=0.0, repetition_penalty=1.0, ignore_eos=False, no_stop_trim=False,
                         stop=None, stop_token_ids=None)
    assert plain["top_k"] == -1  # 0 (off) is -1 to SGLang: 0 fails its check "top_k must be -1 (disable) or at least 1"
    changed = dict(max_tokens=8, temperature=0.7, top_p=0.9, stop=("END",), seed=3, ignore_eos=True,
                   presence_penalty=0.5, frequency_penalty=0.25, top_k=20, min_p=0.05, repetition_penalty=1.2,
                   stop_token_ids=(9,), include_stop_str_in_output=True)
    per_request = {"n", "logprobs", "response_format", "seed"}  # request arguments, the grammar, each sample's seed
    per_request.add("max_thinking_tokens")  # refused for sglang by its capability row: no reasoning parser here
    assert {f.name for f in dataclasses.fields(Sampling)} - per_request == set(changed) - {"seed"}, "a new field"
    for name, value in changed.items():
        if name == "seed":
            continue
        assert sampling_params(_sampling(**{name: value})) != plain, f"{name} does not reach SGLang"
    full = sampling_params(_sampling(**changed), json_schema='{"type": "object"}', seed=4)
    assert (full["stop"], full["stop_token_ids"], full["no_stop_trim"], full["sampling_seed"], full["json_schema"]) == (
        ["END"], [9], True, 4, '{"type": "object"}')
    assert set(full) <= SAMPLING_PARAMS_0517


def test_a_rows_response_format_is_sglangs_json_schema():
    assert row_json_schema(json.dumps({"type": "json_object"})) == '{"type": "object"}'
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5}}}
    rf = json.dumps({"type": "json_schema", "schema": schema})
    assert json.loads(row_json_schema(rf)) == schema
    assert "maxLength" not in row_json_schema(rf, "check")  # checked after, as for sampling.output_schema
    assert row_json_schema(None) is None


def test_seeds_need_deterministic_inference_which_a_seeded_sampled_pipeline_turns_on():
    sampled = SamplingConfig(temperature=0.8, seed=1)
    assert deterministic_inference(_engine(), sampled)
    assert not deterministic_inference(_engine(), SamplingConfig())  # greedy: nothing to seed
    assert not deterministic_inference(_engine(sglang={"deterministic_inference": False}), sampled)
    greedy_pipeline = SamplingConfig()  # seed 0, temperature 0
    row = resolve(RowParams(temperature=0.9), greedy_pipeline)
    said = seeded_sampling_refusal(row, deterministic=False)
    assert said is not None and "engine.sglang.deterministic_inference: true" in said and "sampling.seed: null" in said
    assert seeded_sampling_refusal(row, deterministic=True) is None
    assert seeded_sampling_refusal(resolve(RowParams(temperature=0.9), SamplingConfig(seed=None)),
                                   deterministic=False) is None
    assert seeded_sampling_refusal(resolve(None, greedy_pipeline), deterministic=False) is None


# ------------------------------------------------------------------------------------------ SGLang's failures
# managers/tokenizer_manager.py (_validate_one_request), sampling/sampling_params.py (verify)
ROW_FAULTS = [
    ValueError("The input (600 tokens) is longer than the model's context length (512 tokens)."),
    ValueError("Requested token count exceeds the model's maximum context length of 512 tokens. You requested a "
               "total of 700 tokens: 600 tokens from the input messages and 100 tokens for the completion. Please "
               "reduce the number of tokens in the input messages or the completion to fit within the limit."),
    ValueError("repetition_penalty must be in (0, 2] (1.0 = no penalty), got 5.0."),
    ValueError("top_k must be -1 (disable) or at least 1, got 0."),
]


class RequestAbortedError(ValueError):
    """SGLang's own (managers/tokenizer_manager.py): a ValueError with status 499, raised for a request that was
    aborted; the classification goes by its name, as SGLang is not importable here."""

    status_code = 499


def _engine_faults():
    from fastapi import HTTPException

    # _handle_abort_finish_reason: the scheduler aborted the request with 500 / 503
    return [HTTPException(status_code=500, detail="Internal server error"),
            HTTPException(status_code=503, detail="The server is shutting down"),
            RequestAbortedError("Request 3f2a was aborted"), RuntimeError("CUDA error: an illegal memory access")]


def test_sglangs_request_checks_are_row_errors_and_its_aborts_the_engines():
    from fastapi import HTTPException

    assert all(sglang_request_refusal(e) for e in ROW_FAULTS)
    assert sglang_request_refusal(HTTPException(status_code=400, detail="Invalid grammar request"))
    assert not any(sglang_request_refusal(e) for e in _engine_faults())


# model_executor/pool_configurator.py; model_executor/runner/decode_cuda_graph_runner.py and
# runner_backend_utils/__init__.py (CUDA_GRAPH_CAPTURE_FAILED_MSG); entrypoints/engine.py (_scheduler_died_error)
NO_KV_POOL = "RuntimeError: Not enough memory. Please try to increase --mem-fraction-static. Current value: " \
             "mem_fraction_static=0.3"
GRAPH_OOM = ("Scheduler hit an exception: Traceback (most recent call last):\nException: Capture cuda graph "
             "failed: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.81 GiB of "
             "which 1.02 GiB is free.\nPossible solutions:\n1. set --mem-fraction-static to a smaller value (e.g., 0.8 "
             "or 0.7)\n2. set --cuda-graph-max-bs-decode to a smaller value (e.g., 16)\n")
DIED = ("RuntimeError: Rank 0 scheduler died during initialization (exit code: 1). If exit code is -9 (SIGKILL), a "
        "common cause is the OS OOM killer. Run `dmesg -T | grep -i oom` to check.")


def test_start_failures_say_whether_smaller_settings_can_help():
    assert classify_sglang_start_failure(GRAPH_OOM) == (True, None)
    memory, hint = classify_sglang_start_failure(NO_KV_POOL)  # SGLang asks for a larger share: backing off cannot help
    assert not memory and "raise engine.gpu_memory_utilization" in hint
    assert classify_sglang_start_failure(DIED) == (False, None)


# ------------------------------------------------------------------------------------------ the engine, faked SGLang
class FakeSglang:
    """SGLang's Engine as the engine module uses it after start: its event loop, ``async_generate`` answering as
    SGLang 0.5.19 answered on this CPU (outputs copied from a run), its child processes, its tokenizer."""

    def __init__(self, answer):
        self.loop = asyncio.new_event_loop()
        self.answer = answer
        self.calls: list[dict] = []
        self.tokenizer_manager = types.SimpleNamespace(tokenizer=types.SimpleNamespace(decode=lambda ids: f"<{ids[0]}>"),
                                                       context_len=512)

    async def async_generate(self, **kw):
        self.calls.append(kw)
        await asyncio.sleep(0)
        return self.answer(kw)

    def get_all_child_pids(self):
        return []


def _output(text, n_tokens, reason="stop", prompt=5, logprobs=None):
    meta = {"id": "9c65", "finish_reason": {"type": reason, "length": n_tokens} if reason == "length" else
            {"type": reason, "matched": 2}, "prompt_tokens": prompt, "weight_version": "default",
            "num_retractions": 0, "reasoning_tokens": 0, "completion_tokens": n_tokens, "cached_tokens": 0}
    if logprobs is not None:
        meta["output_token_logprobs"] = [(lp, tid, None) for lp, tid in logprobs]
        meta["output_top_logprobs"] = [[(lp, tid, None), (lp - 1.0, tid + 1, None)] for lp, tid in logprobs]
    return {"text": text, "output_ids": list(range(n_tokens)), "meta_info": meta}


def _started(answer, **sampling) -> tuple[SglangEngine, FakeSglang]:
    eng = SglangEngine("/m", _engine(), SamplingConfig(**sampling))
    eng.engine = FakeSglang(answer)
    eng.deterministic = deterministic_inference(eng.cfg, eng.sampling)
    eng.max_running = 4
    return eng, eng.engine


def test_results_error_rows_and_samples_from_sglangs_answers():
    def answer(kw):
        ids = kw["input_ids"]
        if ids[0] == 666:
            raise ROW_FAULTS[0]
        if kw["return_logprob"]:
            return _output("Hello there!", 2, "length", logprobs=[(-2.1, 19556), (-0.8, 653)])
        return _output(f"answer {ids[0]}", 3)

    eng, fake = _started(answer, seed=None)
    reqs = [GenRequest("a", [1, 2]), GenRequest("long", [666] * 3), GenRequest("lp", [3], params=RowParams(logprobs=1)),
            GenRequest("n", [4], params=RowParams(n=3, temperature=0.9)),
            GenRequest("seeded", [5], params=RowParams(temperature=0.9, seed=5))]
    out = {r.key: r for r in eng.generate(reqs)}
    assert (out["a"].text, out["a"].finish_reason, out["a"].prompt_tokens, out["a"].completion_tokens) == (
        "answer 1", "stop", 5, 3)
    assert out["long"].error == ("engine rejected the request: The input (600 tokens) is longer than the model's "
                                 "context length (512 tokens).")
    lp = out["lp"].samples[0].logprobs
    assert [(t.token, t.logprob, [(c.token, c.logprob) for c in t.top]) for t in lp] == [
        ("<19556>", -2.1, [("<19556>", -2.1)]), ("<653>", -0.8, [("<653>", -0.8)])]
    assert len(out["n"].samples) == 3 and out["n"].completion_tokens == 9
    assert "engine.sglang.deterministic_inference" in out["seeded"].error
    n_calls = [c for c in fake.calls if c["input_ids"] == [4]]
    assert len(n_calls) == 3 and all("sampling_seed" not in c["sampling_params"] for c in n_calls)


def test_seeded_samples_differ_by_seed_on_a_deterministic_engine():
    eng, fake = _started(lambda kw: _output("x", 1), temperature=0.8, seed=11)
    assert eng.deterministic
    list(eng.generate([GenRequest("n", [4], params=RowParams(n=3))]))
    assert sorted(c["sampling_params"]["sampling_seed"] for c in fake.calls) == [11, 12, 13]


@pytest.mark.parametrize("fault", range(4))
def test_sglangs_engine_failures_fail_the_shard_not_a_row(fault):
    def answer(kw):
        if kw["input_ids"] == [2]:
            raise _engine_faults()[fault]
        return _output("ok", 1)

    eng, _ = _started(answer)
    with pytest.raises(EngineFailed, match="SGLang's engine failed mid-shard"):
        list(eng.generate([GenRequest(str(i), [i]) for i in range(1, 5)]))


def test_a_dead_sglang_process_fails_the_shard_instead_of_waiting(monkeypatch):
    never = asyncio.Event()

    async def hang(**kw):
        await never.wait()

    eng, fake = _started(lambda kw: None)
    fake.async_generate = hang
    monkeypatch.setattr(eng, "_children_alive", lambda: False)
    monkeypatch.setattr(asyncio, "wait", _instant_wait(asyncio.wait))
    with pytest.raises(EngineFailed, match="scheduler or detokenizer process ended"):
        list(eng.generate([GenRequest("a", [1])]))


def _instant_wait(wait):
    async def quick(fs, timeout=None, return_when=asyncio.ALL_COMPLETED):
        return await wait(fs, timeout=0.01, return_when=return_when)
    return quick


def test_an_aborted_sample_is_an_error_row():
    out = _output("", 0)
    out["meta_info"]["finish_reason"] = {"type": "abort", "message": "Abort in waiting queue"}
    assert gen_result("k", [out], None, many=False).error == "engine aborted the request: Abort in waiting queue"


# ------------------------------------------------------------------------------------------ start, faked SGLang
@pytest.fixture
def fake_sglang(monkeypatch):
    """A stand-in ``sglang`` package whose Engine fails its start the way SGLang's does: the scheduler process
    prints why (here: this process's stderr, which the engine captures as it captures SGLang's processes') and the
    Engine raises its generic RuntimeError (entrypoints/engine.py: _wait_for_scheduler_ready)."""
    starts: list[dict] = []

    ServerArgs = dataclasses.make_dataclass(  # noqa: N806 - SGLang's class name
        "ServerArgs", [(name, object, dataclasses.field(default=None)) for name in sorted(SERVER_ARGS_0517)])

    class Engine:
        fails_with = GRAPH_OOM

        def __init__(self, **kw):
            starts.append(kw)
            if kw["mem_fraction_static"] > 0.8:
                os.write(2, self.fails_with.encode())  # a scheduler process writes to the inherited fd 2
                raise RuntimeError("Initialization failed. Please see the error messages above.")
            self.server_args = types.SimpleNamespace(**kw)

    pkg = types.ModuleType("sglang")
    pkg.__version__ = "0.5.17"
    mods = {"sglang": pkg, "sglang.srt": types.ModuleType("sglang.srt"),
            "sglang.srt.entrypoints": types.ModuleType("sglang.srt.entrypoints"),
            "sglang.srt.entrypoints.engine": types.ModuleType("sglang.srt.entrypoints.engine"),
            "sglang.srt.server_args": types.ModuleType("sglang.srt.server_args")}
    mods["sglang.srt.entrypoints.engine"].Engine = Engine
    mods["sglang.srt.server_args"].ServerArgs = ServerArgs
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(SglangEngine, "_settings", lambda self, args, on_gpu: {"args": args})
    monkeypatch.setattr("batch_llm.engines.output_capture.OutputTail.text", _tail_text_quick)
    return Engine, starts


def _tail_text_quick(self, settle_seconds: float = 0.2) -> str:
    if self._thread is not None:
        self._thread.join(timeout=settle_seconds)
    return "".join(self.lines)


def test_an_sglang_out_of_memory_start_is_retried_smaller(fake_sglang, tmp_path):
    from batch_llm.engines.start import start_engine

    _, starts = fake_sglang
    cfg = demo_config(tmp_path, engine__kind="sglang", engine__gpu_memory_utilization=0.9)
    engine, info = start_engine(str(tmp_path), cfg, say=lambda m: None)
    assert [s["mem_fraction_static"] for s in starts] == [0.9, 0.85, 0.8]
    assert [a.get("memory") for a in info.attempts] == [True, True, None]
    assert info.config.gpu_memory_utilization == 0.8
    assert all(s["custom_sigquit_handler"].__name__ == "_child_failed" for s in starts)


def test_sglang_asking_for_a_larger_share_is_not_retried_smaller(fake_sglang, tmp_path):
    from batch_llm.engines.start import start_engine

    Engine, starts = fake_sglang
    Engine.fails_with = NO_KV_POOL
    cfg = demo_config(tmp_path, engine__kind="sglang", engine__gpu_memory_utilization=0.9)
    with pytest.raises(EngineStartError) as e:
        start_engine(str(tmp_path), cfg, say=lambda m: None)
    assert not e.value.memory and len(starts) == 1
    assert "raise engine.gpu_memory_utilization" in str(e.value)


def test_an_extra_key_this_sglang_lacks_fails_the_start_naming_it(fake_sglang, tmp_path):
    eng = SglangEngine(str(tmp_path), _engine(extra={"enable_frobnication": True}), SamplingConfig())
    with pytest.raises(EngineStartError, match=r"SGLang 0.5.17's ServerArgs has no field\(s\) \['enable_frobnication'\]"):
        eng.start()


def test_the_manifest_records_what_sglangs_schedulers_resolved():
    # get_server_info() of SGLang 0.5.19 on this CPU (keys and values from the run; the rest left out)
    info = {"chunked_prefill_size": 2048, "grammar_backend": "xgrammar", "max_running_requests": 8,
            "mem_fraction_static": 0.5, "context_length": 512, "max_total_num_tokens": 4096, "dtype": "float32",
            "kv_cache_dtype": "auto", "tp_size": 1, "device": "cpu", "attention_backend": "torch_native",
            "sampling_backend": "pytorch", "disable_radix_cache": False, "disable_cuda_graph": False,
            "enable_deterministic_inference": False,
            "cuda_graph_config": {"decode": {"backend": "disabled", "max_bs": 32}, "prefill": {"backend": "disabled"}},
            "internal_states": [{"effective_max_running_requests_per_dp": 8}]}
    eng, fake = _started(lambda kw: None)
    fake.get_server_info = lambda: info
    s = eng._settings({}, on_gpu=False)
    assert (s["max_num_seqs"], s["max_total_num_tokens"], s["chunked_prefill_size"], s["gpu_memory_utilization"],
            s["grammar_backend"], s["max_model_len"]) == (8, 4096, 2048, 0.5, "xgrammar", 512)
    assert s["enforce_eager"] and s["cuda_graph_max_bs"] is None  # the CPU captures no graphs
    info["cuda_graph_config"]["decode"]["backend"] = "full"
    assert eng._settings({}, on_gpu=True)["cuda_graph_max_bs"] == 32 and eng.max_running == 8
