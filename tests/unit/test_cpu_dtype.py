"""engine.dtype auto on a CPU: float32 where bfloat16 would be emulated, the checkpoint's dtype elsewhere."""
from __future__ import annotations

import json

import pytest
from batch_llm.host import probes


def _cpuinfo(tmp_path, flags: str) -> str:
    p = tmp_path / "cpuinfo"
    p.write_text(f"processor\t: 0\nmodel name\t: test\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n")
    return str(p)


def test_native_bf16_is_read_from_the_cpu_flags(tmp_path):
    assert not probes.cpu_has_native_bf16(_cpuinfo(tmp_path, "fpu sse2 avx avx2 fma f16c"))
    assert probes.cpu_has_native_bf16(_cpuinfo(tmp_path, "avx2 avx512f avx512_bf16"))
    assert probes.cpu_has_native_bf16(_cpuinfo(tmp_path, "avx2 amx_bf16 amx_tile"))
    assert probes.cpu_has_native_bf16(str(tmp_path / "missing"))  # unknown: leave the checkpoint's dtype alone


@pytest.mark.parametrize("native, dtype, quantized, on_gpu, expected", [
    (False, "auto", False, False, "float32"),      # the case it exists for
    (False, "bfloat16", False, False, "bfloat16"),  # an explicit choice is kept
    (False, "auto", True, False, "auto"),          # quantized kernels want 16-bit activations
    (False, "auto", False, True, "auto"),          # GPUs compute bf16
    (True, "auto", False, False, "auto"),          # AVX-512 BF16 / AMX CPUs too
])
def test_cpu_dtype(tmp_path, monkeypatch, native, dtype, quantized, on_gpu, expected):
    monkeypatch.setattr(probes, "cpu_has_native_bf16", lambda: native)
    config = {"torch_dtype": "bfloat16"}
    if quantized:
        config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert probes.cpu_dtype(dtype, str(tmp_path), on_gpu=on_gpu) == expected


def _ct(weights: dict, acts: dict | None) -> dict:
    return {"quant_method": "compressed-tensors",
            "config_groups": {"group_0": {"weights": weights, "input_activations": acts}}}


def test_fp8_channel_weights_are_told_from_int_and_other_fp8_layouts():
    """What the vLLM engine refuses on a CPU without AMX-FP8: FP8_DYNAMIC's per-channel float-8 weights."""
    fp8_dynamic = _ct({"type": "float", "num_bits": 8, "strategy": "channel"},
                      {"type": "float", "num_bits": 8, "strategy": "token", "dynamic": True})
    assert probes.is_fp8_channel_weights(fp8_dynamic) and not probes.is_int_weight_only(fp8_dynamic)
    w4a16 = _ct({"type": "int", "num_bits": 4, "strategy": "group"}, None)
    assert probes.is_int_weight_only(w4a16) and not probes.is_fp8_channel_weights(w4a16)
    per_tensor = _ct({"type": "float", "num_bits": 8, "strategy": "tensor"}, {"type": "float", "num_bits": 8})
    assert not probes.is_fp8_channel_weights(per_tensor)  # vLLM's CPU has an AMX kernel for it without AMX-FP8
    assert not probes.is_fp8_channel_weights({"quant_method": "awq", "bits": 4}) and not probes.is_fp8_channel_weights({})
