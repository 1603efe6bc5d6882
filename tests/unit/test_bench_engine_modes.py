"""The inference benchmark's SGLang and reasoning modes, without an engine: what each stage mode is configured with
(random weights as each engine takes them, the SGLang settings a stage-x run varies, thinking on with its budget on
top of the answer, thinking off), which runs get which engine and PYTHONPATH, and the ratios the summary makes."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import inference  # noqa: E402


def _args(*argv: str):
    return inference.build_parser().parse_args(["--model", "/m", *argv])


def test_the_sglang_stage_gets_random_weights_and_keeps_its_tokenizer():
    a = _args("--engine", "sglang", "--dummy", "--tokenizer", "/tok", "--dataset", "mix")
    cfg = inference.stage_config(a)
    assert cfg.engine.kind == "sglang"
    assert cfg.engine.extra == {"load_format": "dummy"}  # no skip_tokenizer_init: SGLang's engine refuses it
    # vLLM beside it detokenizes too when the folder has a tokenizer (the same work as SGLang's)
    v = inference.stage_config(_args("--dummy", "--tokenizer", "/tok", "--dataset", "mix"))
    assert v.engine.extra == {"load_format": "dummy", "skip_tokenizer_init": False}
    assert inference.stage_config(_args("--dummy")).engine.extra == {"load_format": "dummy",
                                                                      "skip_tokenizer_init": True}


def test_stage_x_merges_engine_keys_and_the_plain_stage_keeps_the_defaults():
    a = _args("--engine", "sglang", "--dummy", "--tokenizer", "/tok",
              "--stage-engine", json.dumps({"sglang": {"cuda_graph_max_bs": 512}, "max_num_seqs": 1024}))
    x, plain = inference.stage_config(a, "stage-x"), inference.stage_config(a)
    assert (x.engine.sglang.cuda_graph_max_bs, x.engine.max_num_seqs) == (512, 1024)
    assert (plain.engine.sglang.cuda_graph_max_bs, plain.engine.max_num_seqs) == (None, None)


def test_thinking_on_has_its_budget_and_the_parser_thinking_off_neither():
    a = _args("--dummy", "--tokenizer", "/tok", "--dataset", "chat", "--thinking-budget", "128", "--out-len", "64")
    on, off = inference.stage_config(a, "stage"), inference.stage_config(a, "stage-think-off")
    assert (on.sampling.thinking, on.sampling.max_thinking_tokens, on.engine.reasoning_parser) == ("on", 128, "auto")
    assert on.sampling.max_tokens == 64 + 128 and on.sampling.ignore_eos
    assert (off.sampling.thinking, off.sampling.max_thinking_tokens) == ("off", None)


@pytest.mark.parametrize("argv, message", [
    (["--engine", "sglang", "--dummy"], "needs --tokenizer"),
    (["--engine", "sglang", "--modes", "raw-tuned,stage"], "raw-tuned"),
    (["--dataset", "mix", "--thinking-budget", "64"], "--thinking-budget"),
    (["--dataset", "chat", "--thinking-budget", "64", "--modes", "raw,stage"], "--thinking-budget"),
    (["--modes", "stage,tgi:stage"], "ENGINE:MODE"),
])
def test_runs_that_cannot_be_made_are_refused(argv, message, capsys):
    p = inference.build_parser()
    with pytest.raises(SystemExit):
        inference.check_args(p, p.parse_args(["--model", "/m", *argv]))
    assert message in capsys.readouterr().err


def test_engine_paths_and_the_ratios_against_the_stage_on_vllm():
    p = inference.build_parser()
    a = p.parse_args(["--model", "/m", "--engine", "sglang", "--dummy", "--tokenizer", "/t",
                      "--modes", "raw,stage,vllm:stage", "--engine-path", "sglang=/root/sgl:inc",
                      "--engine-path", "vllm=/root/site:inc"])
    assert inference.check_args(p, a) == {"sglang": "/root/sgl:inc", "vllm": "/root/site:inc"}

    def run(wall, tok_s):
        return {"wall_s": wall, "outputs_s": wall - 1, "generate_s": 10.0, "generated_tok_s": tok_s,
                "generated_tokens": 1000, "delivered_tokens": 1100}

    out = inference.summarize({"raw": [run(60, 900), run(62, 950)], "stage": [run(70, 1000), run(72, 1000)],
                               "vllm:stage": [run(80, 800), run(84, 820)]})
    assert out["stage_over_vllm:stage"]["whole_process"] == round(82 / 71, 3)
    assert out["stage_over_vllm:stage"]["generated_tok_s_in_generation"] == round(1000 / 810, 3)
    assert out["stage_over_raw"]["whole_process"] == round(61 / 71, 3)
