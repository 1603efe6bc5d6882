"""Probes the engines read before they start: the model folder's config.json (context limit, quantization), a LoRA
adapter's rank (and the ``max_lora_rank`` vLLM takes for it), this CPU's features (native bfloat16), and the dtype
an engine gets from them."""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any


def model_config_json(model_dir: str) -> dict:
    """The model folder's config.json as a dict ({} when it is missing, unreadable or not an object)."""
    import json

    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def model_chat_template(model_dir: str) -> str:
    """The chat template the model folder ships (``chat_template.jinja``, else ``tokenizer_config.json``'s), read
    without loading a tokenizer; "" where it has none."""
    import json

    jinja = os.path.join(model_dir, "chat_template.jinja")
    if os.path.exists(jinja):
        with open(jinja, encoding="utf-8") as f:
            return f.read()
    try:
        with open(os.path.join(model_dir, "tokenizer_config.json"), encoding="utf-8") as f:
            value = json.load(f).get("chat_template")
    except (OSError, ValueError, AttributeError):
        return ""
    return value if isinstance(value, str) else json.dumps(value or "")


def model_context_limit(model_dir: str) -> int | None:
    """The longest context the model was built for (``max_position_embeddings`` in its config.json, or its
    text config's), when the folder says; None otherwise."""
    config = model_config_json(model_dir)
    for c in (config, config.get("text_config") or {}):
        v = c.get("max_position_embeddings") if isinstance(c, dict) else None
        if isinstance(v, int) and v > 0:
            return v
    return None


def model_quantization(model_dir: str) -> dict:
    """The ``quantization_config`` of the model's config.json ({} when unquantized or unreadable)."""
    qc = model_config_json(model_dir).get("quantization_config")
    return qc if isinstance(qc, dict) else {}


def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU computes bfloat16 natively (AVX-512 BF16 or AMX); True where it cannot be read."""
    try:
        with open(cpuinfo) as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return True
    return not flags or "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_dtype(dtype: str, model_dir: str, *, on_gpu: bool) -> str:
    """``engine.dtype`` as the engine gets it: ``auto`` on a CPU without native bfloat16 becomes float32 for an
    unquantized model. There a bf16 checkpoint's ``auto`` runs emulated bf16 kernels: on this project's CI
    CPU (AVX2) 128 chat rows took 570 s of generation in bf16 and 119 s in float32 (bench/swift.py).
    Quantized checkpoints keep their own dtype (their kernels want 16-bit activations)."""
    if dtype != "auto" or on_gpu or model_quantization(model_dir) or cpu_has_native_bf16():
        return dtype
    return "float32"


def is_fp8_channel_weights(qc: dict) -> bool:
    """True for compressed-tensors 8-bit float weights scaled per output channel (quantize.scheme FP8_DYNAMIC)."""
    if str(qc.get("quant_method", "")).lower() != "compressed-tensors":
        return False
    groups = (qc.get("config_groups") or {}).values()
    return any((g.get("weights") or {}).get("type") == "float" and (g.get("weights") or {}).get("num_bits") == 8
               and (g.get("weights") or {}).get("strategy") == "channel" for g in groups if isinstance(g, dict))


def is_int_weight_only(qc: dict) -> bool:
    """True for integer weights with 16-bit activations (AWQ, GPTQ, compressed-tensors W4A16/W8A16)."""
    method = str(qc.get("quant_method", "")).lower()
    if method in ("awq", "gptq"):
        return True
    if method != "compressed-tensors":
        return False
    groups = (qc.get("config_groups") or {}).values()
    return any((g.get("weights") or {}).get("type") == "int" and g.get("input_activations") is None
               for g in groups if isinstance(g, dict))


def processor_settings(model_dir: str) -> dict[str, Any]:
    """The model's image processor settings, as its files hold them: ``preprocessor_config.json`` and the
    ``image_processor`` section (and top level) of ``processor_config.json``."""
    found: dict[str, Any] = {}
    for name in ("preprocessor_config.json", "processor_config.json"):
        try:
            data = json.loads((Path(model_dir) / name).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict):
            found.update({k: v for k, v in data.items() if not isinstance(v, dict)})
            if isinstance(data.get("image_processor"), dict):
                found.update(data["image_processor"])
    for meta in ("processor_class", "image_processor_type", "auto_map"):
        found.pop(meta, None)
    return found


def processor_kwargs_refusal(model_dir: str, kwargs: dict) -> str | None:
    """Why ``engine.mm_processor_kwargs`` cannot be honoured for this model, or None: each key must be a setting its
    image processor has (vLLM would pass an unknown one to a processor that ignores it, or drop it with a
    warning; transformers' processor likewise)."""
    if not kwargs:
        return None
    has = processor_settings(model_dir)
    if not has:
        return (f"engine.mm_processor_kwargs: the model at {model_dir} has no image processor settings "
                "(preprocessor_config.json or processor_config.json): it is not a vision-language model this engine "
                "can set up; remove engine.mm_processor_kwargs")
    unknown = sorted(set(kwargs) - set(has))
    if unknown:
        return (f"engine.mm_processor_kwargs.{', '.join(unknown)}: the model's image processor has no such "
                f"setting (it has: {', '.join(sorted(has))}); remove it or use a model whose processor takes it "
                "(min_pixels / max_pixels: Qwen2-VL's)")
    return None


# A LoRA adapter's folder: what the engines size vLLM's and SGLang's LoRA slots by, and the fetch stage's check reads
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
# vLLM's max_lora_rank takes one of these (vllm.config.lora.MaxLoRARanks)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def safetensors_shapes(path: Path) -> dict[str, list[int]] | None:
    """Tensor shapes from a safetensors header (the weights are not read); None when it is not one."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n)) if 0 < n <= path.stat().st_size - 8 else None
    except (OSError, ValueError, struct.error):
        return None
    if not isinstance(header, dict):
        return None
    return {k: t["shape"] for k, t in header.items() if k != "__metadata__" and isinstance(t, dict)}


def adapter_shapes(path: Path) -> dict[str, list[int]] | None:
    if path.suffix == ".safetensors":
        return safetensors_shapes(path)
    import torch  # a .bin adapter: a pickled state dict (small), loaded without running code

    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - any failure means the file is not a readable state dict
        return None
    return {k: list(v.shape) for k, v in state.items()} if isinstance(state, dict) else None


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest rank vLLM accepts as ``max_lora_rank`` that holds ``rank``."""
    for allowed in VLLM_LORA_RANKS:
        if rank <= allowed:
            return allowed
    raise ValueError(f"LoRA rank {rank} is above vLLM's largest max_lora_rank ({VLLM_LORA_RANKS[-1]})")


def adapter_rank(adapter_dir: str) -> int:
    """The adapter's largest rank, from its weights (as at fetch); its config's ``r`` when they are unreadable."""
    root = Path(adapter_dir)
    for w in ADAPTER_WEIGHTS:
        shapes = adapter_shapes(root / w) if (root / w).is_file() else None
        if shapes:
            return max(s[0] for n, s in shapes.items() if n.endswith(".lora_A.weight"))
    return int(json.loads((root / ADAPTER_CONFIG).read_text(encoding="utf-8"))["r"])
