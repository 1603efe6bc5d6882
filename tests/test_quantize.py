"""The 4-bit export, for real: llm-compressor AWQ in the quantize environment, cached, then served by vLLM.

One export of the demo model (SmolLM2-135M-Instruct) with a deliberately small calibration (AWQ grid 3,
4 samples x 64 tokens) runs once for the module; the cache, the lock and the error path are checked
around it, and vLLM (main environment, CPU) generates from the exported checkpoint.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from batch_llm import quantize as q
from batch_llm.config import QuantizeConfig
from batch_llm.demo_model import default_cache_dir, snapshot_dir

REPO = Path(__file__).resolve().parents[1]
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
    # argv: -m batch_llm.quantize MODEL_DIR OUT_DIR CFG_JSON
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


def test_vllm_serves_the_export(export, tmp_path):
    if not MAIN_PYTHON.exists():
        pytest.skip("main environment missing")
    _, result = export
    script = tmp_path / "serve.py"
    script.write_text(VLLM_SCRIPT)
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1")
    log_file = tmp_path / "vllm.log"
    with open(log_file, "w") as log:
        proc = subprocess.run([str(MAIN_PYTHON), str(script), result["model_dir"]], env=env, cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=log, text=True, timeout=540)
    output = proc.stdout + log_file.read_text()
    if proc.returncode != 0:
        errors = [x for x in output.splitlines() if "Error" in x or "error" in x][:30]
        pytest.fail(f"vLLM failed (exit {proc.returncode}); log {log_file}\nerror lines:\n" + "\n".join(errors)
                    + "\n--- tail ---\n" + output[-3000:])
    assert "CompressedTensorsWNA16" in output  # quantization detected from config.json, 4-bit kernel
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    got = json.loads(line.removeprefix("RESULT "))
    print(f"\nvllm: engine ready in {got['start_seconds']}s; outputs: {got['texts']}")
    assert len(got["texts"]) == 2 and all(t.strip() for t in got["texts"])
