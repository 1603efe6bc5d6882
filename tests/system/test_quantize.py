"""The 4-bit export, for real: llm-compressor AWQ in the quantize environment, cached, then served by vLLM.

One export of the demo model (SmolLM2-135M-Instruct) with a deliberately small calibration (AWQ grid 3,
4 samples x 64 tokens) runs once for the module; the cache, the lock and the error path are checked
around it, and vLLM (main environment, CPU) generates from the exported checkpoint.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from batch_llm.config import QuantizeConfig
from batch_llm.demo_model import default_cache_dir, snapshot_dir
from batch_llm.stages import quantize as q
from helpers import run_in_group, vllm_cpu_env

REPO = Path(__file__).resolve().parents[2]
MAIN_PYTHON = REPO / ".venv" / "bin" / "python"
MODEL_DIR = snapshot_dir(default_cache_dir())
MODEL_KEY = "HuggingFaceTB/SmolLM2-135M-Instruct@master#demo"

# Fast AWQ: the smallest grid llm-compressor accepts and a handful of calibration tokens.
FAST_AWQ = dict(enabled=True, method="awq", awq_grid=3, calibration_samples=4, calibration_seq_len=64,
                group_size=64)


def _need_model_and_env() -> None:
    if not (MODEL_DIR / "config.json").exists():
        pytest.skip(f"demo model not built at {MODEL_DIR} (python -m batch_llm.demo_model)")
    if not Path(q.quantize_python(QuantizeConfig())).exists():
        pytest.skip("quantize environment missing (scripts/setup.sh)")


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    _need_model_and_env()
    cache = tmp_path_factory.mktemp("quantized")
    cfg = QuantizeConfig(**FAST_AWQ, cache_dir=str(cache))
    started = time.monotonic()
    result = q.quantize_model(str(MODEL_DIR), cfg, model_key=MODEL_KEY)
    print(f"\nquantize: export took {time.monotonic() - started:.1f}s "
          f"(in the exporter: {result['export_seconds']}s)")
    return cfg, result


def test_export_writes_a_compressed_tensors_w4a16_checkpoint(export):
    cfg, result = export
    out = Path(result["model_dir"])
    assert result["cache_hit"] is False
    assert out.parent == Path(cfg.cache_dir) and out.is_dir()
    config = json.loads((out / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors"
    assert qc["format"] == "pack-quantized"
    (group,) = qc["config_groups"].values()
    assert group["weights"]["num_bits"] == 4
    assert group["weights"]["type"] == "int"
    assert group["weights"]["strategy"] == "group" and group["weights"]["group_size"] == 64
    assert group["input_activations"] is None  # A16: activations stay 16-bit
    assert "lm_head" in qc["ignore"]
    # tokenizer and chat template travel with the weights
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (out / name).exists(), name
    assert list(out.glob("*.safetensors"))
    info = json.loads((out / q.INFO_FILE).read_text())
    assert info["method"] == "awq" and info["scheme"] == "W4A16" and info["group_size"] == 64
    assert result["size_bytes"] == info["size_bytes"] > 0
    src_size = sum(p.stat().st_size for p in MODEL_DIR.glob("*.safetensors"))
    assert info["size_bytes"] < 0.6 * src_size  # int4 linears; the tied bf16 embedding stays
    # nothing half-written is left beside it
    assert not [p for p in out.parent.iterdir() if p.name.endswith(".partial")]


def test_second_call_is_a_cache_hit_without_a_subprocess(export, monkeypatch):
    cfg, first = export

    def no_subprocess(*a, **k):
        raise AssertionError("a cache hit must not start the exporter")

    monkeypatch.setattr(q.subprocess, "Popen", no_subprocess)
    started = time.monotonic()
    again = q.quantize_model(str(MODEL_DIR), cfg, model_key=MODEL_KEY)
    assert time.monotonic() - started < 1.0
    assert again["cache_hit"] is True
    assert again["model_dir"] == first["model_dir"]


def test_cache_key_covers_every_setting(tmp_path):
    base = QuantizeConfig(**FAST_AWQ, cache_dir=str(tmp_path))
    key = q.cache_entry_dir(base, MODEL_KEY)
    variants = [base.model_copy(update={k: v}) for k, v in
                (("group_size", 32), ("awq_grid", 4), ("calibration_samples", 8), ("calibration_seq_len", 128),
                 ("method", "rtn"))]
    dirs = {q.cache_entry_dir(v, MODEL_KEY) for v in variants} | {q.cache_entry_dir(base, MODEL_KEY + "x")}
    assert key not in dirs and len(dirs) == len(variants) + 1
    # round-to-nearest reads no calibration data: those settings do not split its cache
    rtn = base.model_copy(update={"method": "rtn"})
    assert q.cache_entry_dir(rtn, MODEL_KEY) == q.cache_entry_dir(
        rtn.model_copy(update={"calibration_samples": 999, "awq_grid": 7}), MODEL_KEY)
    assert key.parent == tmp_path and "/" not in key.name


def test_group_size_that_does_not_divide_the_model_fails_before_exporting(tmp_path):
    _need_model_and_env()
    cfg = QuantizeConfig(**{**FAST_AWQ, "group_size": 128}, cache_dir=str(tmp_path))  # 576 % 128 != 0
    with pytest.raises(ValueError, match=r"group_size=128.*\[32, 64\]"):
        q.quantize_model(str(MODEL_DIR), cfg, model_key=MODEL_KEY)
    with pytest.raises(ValueError, match="awq_grid"):
        q.quantize_model(str(MODEL_DIR), cfg.model_copy(update={"group_size": 64, "awq_grid": 2}),
                         model_key=MODEL_KEY)
    assert not list(tmp_path.iterdir())


def test_exporter_failure_raises_with_the_tail_of_its_output(tmp_path):
    # The main environment has no llm-compressor: the exporter fails on its import, like a broken env would.
    model = tmp_path / "model"
    model.mkdir()
    cfg = QuantizeConfig(**FAST_AWQ, cache_dir=str(tmp_path / "cache"), python=sys.executable)
    with pytest.raises(q.QuantizeError, match=r"(?s)exit code 1.*ModuleNotFoundError"):
        q.quantize_model(str(model), cfg, model_key="broken")
    leftovers = [p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")]
    assert leftovers == []


def test_concurrent_calls_export_once(tmp_path):
    """Two tasks asking for the same export at once: one exports, the other waits and gets a cache hit."""
    runs = tmp_path / "runs.txt"
    fake = tmp_path / "fake-python"
    # argv: -m batch_llm.stages.quantize MODEL_DIR OUT_DIR CFG_JSON
    fake.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        echo run >> {runs}
        sleep 1.5
        tmp="$4.partial"; mkdir -p "$tmp"
        echo '{{}}' > "$tmp/config.json"
        echo '{{"method": "awq", "scheme": "W4A16", "group_size": 64, "size_bytes": 1}}' > "$tmp/{q.INFO_FILE}"
        mv "$tmp" "$4"
        """))
    fake.chmod(0o755)
    cfg = QuantizeConfig(**FAST_AWQ, cache_dir=str(tmp_path / "cache"), python=str(fake))
    results: list[dict] = []
    threads = [threading.Thread(target=lambda: results.append(
        q.quantize_model(str(tmp_path), cfg, model_key="same"))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert runs.read_text().count("run") == 1
    assert sorted(r["cache_hit"] for r in results) == [False, True]
    assert results[0]["model_dir"] == results[1]["model_dir"]


VLLM_SCRIPT = """\
import json, sys, time

if __name__ == "__main__":
    from batch_llm.engines.vllm_engine import _missing_cpu_kernel

    missing = _missing_cpu_kernel(sys.argv[1])
    if missing:
        print("CANNOT_RUN " + missing, flush=True)
        sys.exit(0)
    started = time.monotonic()
    from vllm import LLM, SamplingParams

    llm = LLM(model=sys.argv[1], enforce_eager=True, max_model_len=512)
    ready = time.monotonic() - started
    chats = [[{"role": "user", "content": "What is the capital of France?"}],
             [{"role": "user", "content": "Write one sentence about the sea."}]]
    outs = llm.chat(chats, SamplingParams(max_tokens=32, temperature=0.0))
    print("RESULT " + json.dumps({"start_seconds": round(ready, 1),
                                  "texts": [o.outputs[0].text for o in outs]}), flush=True)
"""

REFUSE_SCRIPT = """\
import sys, time
from batch_llm.config import EngineConfig, SamplingConfig
from batch_llm.engines.base import EngineCannotRun
from batch_llm.engines.vllm_engine import VllmEngine

t0 = time.monotonic()
engine = VllmEngine(sys.argv[1], EngineConfig(kind="vllm", enforce_eager=True, max_model_len=512),
                    SamplingConfig(max_tokens=8))
try:
    engine.start()
except EngineCannotRun as e:
    print(f"REFUSED after {time.monotonic() - t0:.1f}s: {e}", flush=True)
    sys.exit(0)
print("STARTED", flush=True)
sys.exit(1)
"""


@pytest.fixture(scope="module")
def vllm_serves(export, tmp_path_factory):
    """vLLM (main environment, CPU) on the export: ("served", result) or ("cannot_run", why) where this CPU's
    vLLM build has no integer-weight kernel (AVX2-only x86: only the AVX-512 build has cpu_gemm_wna16)."""
    if not MAIN_PYTHON.exists():
        pytest.skip("main environment missing")
    _, result = export
    tmp_path = tmp_path_factory.mktemp("vllm_serve")
    script = tmp_path / "serve.py"
    script.write_text(VLLM_SCRIPT)
    log_file = tmp_path / "vllm.log"
    with open(log_file, "w") as log:
        proc = subprocess.run([str(MAIN_PYTHON), str(script), result["model_dir"]], env=vllm_cpu_env(), cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=log, text=True, timeout=540)
    output = proc.stdout + log_file.read_text()
    if proc.returncode != 0:
        errors = [x for x in output.splitlines() if "Error" in x or "error" in x][:30]
        pytest.fail(f"vLLM failed (exit {proc.returncode}); log {log_file}\nerror lines:\n" + "\n".join(errors)
                    + "\n--- tail ---\n" + output[-3000:])
    cannot = next((x for x in proc.stdout.splitlines() if x.startswith("CANNOT_RUN ")), None)
    if cannot:
        return "cannot_run", cannot.removeprefix("CANNOT_RUN ")
    return "served", (output, proc.stdout)


def _script_line(script: str, model_dir: str, tmp_path, prefix: str | tuple[str, ...]) -> str:
    """Runs a script in the main environment on the export; returns its output line starting with prefix."""
    path = tmp_path / "script.py"
    path.write_text(script)
    proc = run_in_group([str(MAIN_PYTHON), str(path), model_dir], env=vllm_cpu_env(), cwd=tmp_path,
                        timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith(prefix))
    print("\n" + line)
    return line


def test_vllm_serves_the_export(vllm_serves):
    kind, got = vllm_serves
    if kind == "cannot_run":
        pytest.skip(f"this CPU's vLLM build cannot run 4-bit weights ({got}); "
                    "test_vllm_engine_refuses_what_this_cpu_cannot_run checks the refusal instead")
    output, stdout = got
    assert "CompressedTensorsWNA16" in output  # quantization detected from config.json, 4-bit kernel
    line = next(x for x in stdout.splitlines() if x.startswith("RESULT "))
    got = json.loads(line.removeprefix("RESULT "))
    print(f"\nvllm: engine ready in {got['start_seconds']}s; outputs: {got['texts']}")
    assert len(got["texts"]) == 2 and all(t.strip() for t in got["texts"])


def test_vllm_engine_refuses_what_this_cpu_cannot_run(vllm_serves, export, tmp_path):
    """On a CPU whose vLLM build lacks the kernel, the project's engine refuses at start, before loading
    anything, with a message that names the fixes (instead of an engine that dies at its first step)."""
    kind, _ = vllm_serves
    if kind == "served":
        pytest.skip("this CPU's vLLM build runs 4-bit weights (test_vllm_serves_the_export served the export)")
    line = _script_line(REFUSE_SCRIPT, export[1]["model_dir"], tmp_path, "REFUSED")
    assert "cpu_gemm_wna16" in line and "engine.kind: transformers" in line and "quantize.enabled: false" in line


TRANSFORMERS_SCRIPT = """\
import sys
from transformers import AutoTokenizer
from batch_llm.config import EngineConfig, SamplingConfig
from batch_llm.engines.base import GenRequest
from batch_llm.engines.registry import make_engine

tok = AutoTokenizer.from_pretrained(sys.argv[1])
ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                              add_generation_prompt=True, tokenize=True)
ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
engine = make_engine(sys.argv[1], EngineConfig(kind="transformers"), SamplingConfig(max_tokens=16, temperature=0))
engine.start()
(out,) = list(engine.generate([GenRequest(key="q", prompt_token_ids=ids)]))
engine.close()
print("TEXT " + repr(out.text) + " " + str(out.completion_tokens) + " " + str(out.error), flush=True)
"""


def test_transformers_engine_generates_from_the_export(export, tmp_path):
    """The portable engine runs the 4-bit export on any CPU (compressed-tensors decompresses it on load): the
    fallback the vLLM refusal names is real."""
    line = _script_line(TRANSFORMERS_SCRIPT, export[1]["model_dir"], tmp_path, "TEXT ")
    assert "Paris" in line and line.endswith(" None")  # no error


# ---------------------------------------------------------------------------------------------- FP8_DYNAMIC
# vLLM starts its engine core by spawn, which re-imports the script: the body goes under a main guard. A refusal
# to start (EngineCannotRun: no FP8 kernel on this CPU) is printed, not raised.
ENGINE_SCRIPT = "if __name__ == '__main__':\n" + textwrap.indent(TRANSFORMERS_SCRIPT.replace(
    'EngineConfig(kind="transformers")', 'EngineConfig(kind="vllm", enforce_eager=True, max_model_len=512)').replace(
    "engine.start()\n", "from batch_llm.engines.base import EngineCannotRun\ntry:\n    engine.start()\n"
    "except EngineCannotRun as e:\n    print('REFUSED ' + str(e), flush=True)\n    sys.exit(0)\n"), "    ")


def test_fp8_dynamic_export_is_cached_and_served_by_the_vllm_engine(tmp_path):
    """FP8_DYNAMIC for real: llm-compressor writes float8 per-channel weights with per-token dynamic
    activations (no calibration data), a second call is a cache hit, and the project's vLLM engine generates
    from the export (the same checkpoint a Hopper GPU runs natively) where the CPU has AMX-FP8, or refuses it
    with the fixes named where vLLM would run torch's reference FP8 matmul (minutes a token on a larger model),
    and the transformers engine it names generates from it."""
    _need_model_and_env()
    cfg = QuantizeConfig(enabled=True, scheme="FP8_DYNAMIC", cache_dir=str(tmp_path / "cache"))
    result = q.quantize_model(str(MODEL_DIR), cfg, model_key=MODEL_KEY)
    out = Path(result["model_dir"])
    assert result["cache_hit"] is False and out.name.startswith("HuggingFaceTB--SmolLM2-135M-Instruct")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "float-quantized"
    (group,) = qc["config_groups"].values()
    assert (group["weights"]["type"], group["weights"]["num_bits"], group["weights"]["strategy"]) == (
        "float", 8, "channel")
    assert group["input_activations"]["dynamic"] is True and group["input_activations"]["strategy"] == "token"
    assert "lm_head" in qc["ignore"] and (out / "chat_template.jinja").exists()
    info = json.loads((out / q.INFO_FILE).read_text())
    assert (info["scheme"], info["method"], info["group_size"]) == ("FP8_DYNAMIC", "fp8_dynamic", None)
    src_size = sum(p.stat().st_size for p in MODEL_DIR.glob("*.safetensors"))
    assert info["size_bytes"] < 0.75 * src_size  # 8-bit linears; the tied bf16 embedding stays

    assert q.quantize_model(str(MODEL_DIR), cfg, model_key=MODEL_KEY)["cache_hit"] is True

    line = _script_line(ENGINE_SCRIPT, str(out), tmp_path, ("TEXT ", "REFUSED "))
    if line.startswith("REFUSED "):  # a CPU without AMX-FP8: the engine refuses, and the fallback it names serves it
        assert "AMX-FP8" in line and "engine.kind: transformers" in line and "quantize.enabled: false" in line
        line = _script_line(TRANSFORMERS_SCRIPT, str(out), tmp_path, "TEXT ")
    assert line.endswith(" None")  # no error
    assert "Paris" in line
