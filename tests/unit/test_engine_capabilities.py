"""The engine capability table: one row per engine kind decides config validation, the trigger form's choices,
per-row parameters and which module the registry imports. Adding an engine is one module plus one row: a toy
engine (tests/unit/toy_engine.py) added that way is accepted, offered and built; what it lacks is refused,
naming the engines that serve it. No engine-kind string checks are left outside the engines."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from batch_llm.config import ConfigError, EngineConfig, SamplingConfig
from batch_llm.config.capabilities import (
    ENGINES,
    EngineCapabilities,
    capabilities,
    engine_kinds,
    register_capabilities,
    serving,
    who_can,
)
from batch_llm.engines.registry import engine_class, make_engine, register_engine, unregister_engine
from batch_llm.rows.params import RowParams, engine_refusal
from helpers import demo_config

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "include"

# The one row a new engine adds (the module is tests/unit/toy_engine.py).
TOY = EngineCapabilities("toy", "toy_engine", title="a toy engine", penalties=True, tensor_parallel=True,
                         overlap_engine_start=True)


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))
    register_capabilities(TOY)
    yield TOY
    unregister_engine("toy")
    sys.modules.pop("toy_engine", None)


def test_the_table_imports_without_any_engine():
    code = ("import sys, batch_llm.config.capabilities, batch_llm.config, batch_llm.rows.params; "
            "print(sorted(m for m in ('vllm', 'lmdeploy', 'sglang', 'transformers', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_every_builtin_row_names_its_module():
    import importlib.util

    assert engine_kinds() == ["vllm", "lmdeploy", "transformers", "sglang"]
    for kind, caps in ENGINES.items():
        assert caps.kind == kind and importlib.util.find_spec(caps.module) is not None, kind
    assert engine_class("transformers").kind == "transformers"


def test_what_the_builtin_engines_serve():
    assert serving("guided_decoding") == serving("samples_and_logprobs") == serving("lora_served") == ["vllm",
                                                                                                       "sglang"]
    assert serving("speculative") == serving("memory_probe") == serving("compile_cache") == serving("replicas") == [
        "vllm"]
    assert serving("tensor_parallel") == serving("kv_cache_pool") == ["vllm", "lmdeploy", "sglang"]
    assert capabilities("vllm").pooling_tasks == {"embed", "classify"}
    assert not capabilities("lmdeploy").overlap_engine_start  # LMDeploy binds the loop of the thread it starts in
    extra = {"top_k", "min_p", "repetition_penalty", "stop_token_ids", "include_stop_str_in_output"}
    assert serving("reasoning") == ["vllm"]
    base = {"max_tokens", "temperature", "top_p", "stop", "seed", "chat_template_kwargs", "thinking", "reasoning_effort"}
    assert capabilities("vllm").row_params == base | extra | {"presence_penalty", "frequency_penalty", "n",
                                                              "logprobs", "response_format", "max_thinking_tokens",
                                                              "dimensions"}
    assert capabilities("transformers").row_params == base | extra
    assert capabilities("lmdeploy").row_params == base | extra - {"include_stop_str_in_output"}
    assert capabilities("sglang").row_params == capabilities("vllm").row_params - {"max_thinking_tokens", "dimensions"}


def test_unknown_kind_is_refused_naming_the_known_ones(tmp_path):
    with pytest.raises(ConfigError, match=r"engine.kind: .*unknown engine kind 'tgi' \(known: lmdeploy, "
                                          r"sglang, transformers, vllm\)"):
        demo_config(tmp_path, engine__kind="tgi")


def test_transformers_refuses_tensor_parallel(tmp_path):
    with pytest.raises(ConfigError, match=r"engine.tensor_parallel_size: .*engine.kind is 'transformers' "
                                          r"\(vllm, lmdeploy and sglang can\)"):
        demo_config(tmp_path, engine__kind="transformers", engine__tensor_parallel_size=2)
    assert demo_config(tmp_path, engine__kind="lmdeploy", engine__tensor_parallel_size=2).engine.caps.tensor_parallel


def test_a_toy_engine_is_one_module_and_one_row(tmp_path, toy):
    from batch_llm_airflow.params import params_for

    cfg = demo_config(tmp_path, engine__kind="toy", engine__tensor_parallel_size=2)   # config validation
    assert cfg.engine.caps is toy
    form = params_for(cfg)["engine"]                                                   # the trigger form
    assert form.value == "toy" and form.schema["enum"] == ["vllm", "lmdeploy", "transformers", "sglang", "toy"]
    assert form.description == "Inference engine"  # the choices are the dropdown (enum), not repeated here
    engine = make_engine("/nonexistent", cfg.engine, cfg.sampling)                     # the registry
    assert type(engine).__module__ == "toy_engine" and engine.kind == "toy"
    assert engine.start().kind == "toy"
    from batch_llm.engines.base import GenRequest

    [res] = engine.generate([GenRequest("a", [1, 2, 3], params=RowParams(presence_penalty=0.5))])
    assert res.text == "3 tokens"
    assert engine_refusal(RowParams(presence_penalty=0.5), "toy") is None   # its row serves penalties


def test_what_the_toy_lacks_is_refused_naming_who_serves_it(tmp_path, toy):
    cases = [({"engine.speculative": {}}, r"engine.speculative: .*engine.kind is 'toy' \(vllm can\)"),
             ({"engine.compile_cache": str(tmp_path)}, r"engine.compile_cache: .*'toy' \(vllm can\)"),
             ({"engine.task": "embed"}, r"task: embed runs on .*engine.kind is 'toy': set engine.kind: vllm"),
             ({"sampling.n": 2}, r"sampling.n: engine toy returns one sample .*\(vllm and sglang can\)"),
             ({"sampling.output_schema": {"type": "object"}},
              r"engine toy cannot decode under a schema \(vllm and sglang can\)"),
             ({"engine.memory_backoff.probe": True}, r"memory_backoff.probe .*'toy' \(vllm can\)")]
    for overrides, message in cases:
        with pytest.raises(ConfigError, match=message):
            demo_config(tmp_path, engine__kind="toy", **{k.replace(".", "__"): v for k, v in overrides.items()})
    assert engine_refusal(RowParams(n=2), "toy") == "engine toy cannot apply per-row n (vllm and sglang can)"
    # the toy serves tensor parallelism: the refusal for transformers now names it too
    assert who_can("tensor_parallel") == "vllm, lmdeploy, sglang and toy can"
    with pytest.raises(ConfigError, match=r"'transformers' \(vllm, lmdeploy, sglang and toy can\)"):
        demo_config(tmp_path, engine__kind="transformers", engine__tensor_parallel_size=2)


def test_a_served_adapter_is_refused_by_make_engine_from_the_row(toy):
    with pytest.raises(ValueError, match="engine toy cannot serve a LoRA adapter unmerged"):
        make_engine("/nonexistent", EngineConfig(kind="toy"), SamplingConfig(), lora_dir="/adapter")


def test_an_engine_without_a_row_is_refused():
    from batch_llm.engines.base import Engine

    with pytest.raises(TypeError, match="engine kind 'rowless' has no row in the capability table"):
        @register_engine
        class Rowless(Engine):  # noqa: F841
            kind = "rowless"
    with pytest.raises(ValueError, match="already in the capability table"):
        register_capabilities(EngineCapabilities("vllm", "elsewhere"))


# Engine-kind checks left outside engines/, each with why: the doctor reads metrics and settings records whose
# meaning is that engine's own (its static batches, KV-cache numbers, settings names); run_stats (not part of this
# change) defaults the device of LMDeploy's records, which carry none.
ALLOWED = {
    ("doctor.py", "_check_engine"): "advice about the transformers engine's static batches",
    ("doctor.py", "_check_batch_mode"): "decode waste of the transformers engine's static batches (engine.batch_size)",
    ("doctor.py", "_check_padding"): "padding of the transformers engine's static batches",
    ("doctor.py", "_check_max_num_seqs"): "vLLM's max_num_seqs / LMDeploy's max_batch_size in their settings records",
    ("doctor.py", "_check_speculative"): "advice quoting vLLM's n-gram speculation measured on an H200",
    ("doctor.py", "_check_kv_cache"): "vLLM's KV-cache numbers and cpu_kv_cache_gib (its CPU backend)",
    ("doctor.py", "_check_prefix"): "vLLM's prefix-caching default and block_size",
    ("doctor.py", "_check_expected_rate"): "recommend's throughput model is calibrated on vLLM",
    ("run_stats.py", "run_stats"): "LMDeploy's settings records carry no device (it runs on CUDA only)",
}


def _kind_checks() -> list[tuple[str, str, str]]:
    """(file, enclosing function, line) of each engine-kind string check (or list of kinds) in include/, outside
    engines/."""
    kinds = "|".join(map(re.escape, ("vllm", "lmdeploy", "transformers")))
    compare = re.compile(rf"""kind\s*(?:==|!=)\s*["'](?:{kinds})["']|["'](?:{kinds})["']\s*(?:==|!=)\s*\S*kind"""
                         rf"""|kind\s+(?:not\s+)?in\s*[(\[{{][^)\]}}]*["'](?:{kinds})["']"""
                         rf"""|kind:\s*Literal\["""                                      # a list of the kinds as a type
                         rf"""|["'](?:{kinds})["'].*["'](?:{kinds})["']""")                # or as a list of names
    found = []
    for path in sorted(SRC.rglob("*.py")):
        if "engines" in path.relative_to(SRC).parts:
            continue
        func = ""
        for line in path.read_text().splitlines():
            if m := re.match(r"\s*def (\w+)", line):
                func = m.group(1)
            if compare.search(line):
                found.append((path.name, func, line.strip()))
    return found


def test_no_engine_kind_string_checks_outside_the_engines():
    checks = _kind_checks()
    assert checks, "the scan found not even the allowed checks: is it looking at the source?"
    unexplained = [c for c in checks if c[:2] not in ALLOWED]
    assert not unexplained, f"ask the capability table (batch_llm.config.capabilities) instead: {unexplained}"
    stale = set(ALLOWED) - {c[:2] for c in checks}
    assert not stale, f"these checks are gone: drop their allowance here: {sorted(stale)}"


def test_the_docs_capability_table_is_the_table():
    from batch_llm.config.capabilities import markdown_table

    text = (HERE.parents[1] / "docs" / "engines-and-gpus.md").read_text(encoding="utf-8")
    block = text.split("<!-- engine-capabilities:start -->\n", 1)[1].split("\n<!-- engine-capabilities:end -->")[0]
    assert block == markdown_table(), "docs/engines-and-gpus.md: paste batch_llm.config.capabilities.markdown_table()"
