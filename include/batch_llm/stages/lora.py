"""LoRA adapters (``model.lora``): fetched like the model, checked against it, then merged or served.

``merge: true`` merges the adapter into a new model folder with peft (``merge_and_unload``), cached by the hash
of (model files, adapter files): a cache hit does no work, and the merged folder is the model every later stage
and engine sees (quantize included). ``merge: false`` leaves the model as it is and hands the adapter's folder to
the engine (vLLM ``enable_lora`` with a ``LoRARequest`` on every request).

The adapter is checked at fetch, before any shard starts: ``adapter_config.json`` and the weights are there,
and every LoRA matrix fits the module of the base model it targets (a wrong base shows as a missing module or
a shape that does not fit). A failure is an :class:`AdapterInvalid` naming the adapter and what is wrong.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from batch_llm.config import ConfigError
from batch_llm.host.probes import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_shapes, safetensors_shapes

log = logging.getLogger("batch_llm.stages.lora")

MERGED_RECORD = "batch_llm_merged.json"  # written last into a merged folder: its presence is a cache hit
_WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth")


class AdapterInvalid(ConfigError):
    """The adapter lacks a file or does not fit the base model; the message names the adapter and the fault."""


@dataclass(frozen=True)
class AdapterInfo:
    rank: int                       # the largest rank of its matrices (vLLM's max_lora_rank must hold it)
    target_modules: tuple[str, ...]
    base_model_name_or_path: str | None
    weights: str                    # the weights file's name


def _base_shapes(model_dir: str) -> dict[str, list[int]]:
    """Every weight's shape in the base model's safetensors files ({} when its weights are in another format)."""
    shapes: dict[str, list[int]] = {}
    for p in sorted(Path(model_dir).glob("*.safetensors")):
        shapes.update(safetensors_shapes(p) or {})
    return shapes


def _lora_mismatches(adapter: dict[str, list[int]], base: dict[str, list[int]]) -> list[str]:
    """Each LoRA matrix against the base weight it adapts: lora_A is (rank, in), lora_B is (out, rank)."""
    problems = []
    for name, shape in sorted(adapter.items()):
        for part, axis in ((".lora_A.weight", 1), (".lora_B.weight", 0)):
            if not name.endswith(part):
                continue
            module = name.removesuffix(part).removeprefix("base_model.model.")
            target = base.get(f"{module}.weight")
            if target is None:
                problems.append(f"{module} is not a module of the base model")
            elif len(shape) != 2 or len(target) != 2 or shape[axis] != target[axis]:
                problems.append(f"{name} has shape {shape}, which does not fit {module}.weight {target}")
    return problems


def check_adapter(ref: str, adapter_dir: str, model_dir: str) -> AdapterInfo:
    """Refuses an adapter with a missing file, a config that is not LoRA's, or matrices that do not fit the base
    model in ``model_dir``; returns what the engines need of it."""
    root = Path(adapter_dir)

    def invalid(what: str) -> AdapterInvalid:
        return AdapterInvalid(f"model.lora.ref {ref}: {what} (adapter folder {adapter_dir})")

    try:
        config = json.loads((root / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise invalid(f"no {ADAPTER_CONFIG}") from None
    except (OSError, ValueError) as e:
        raise invalid(f"{ADAPTER_CONFIG} is not readable JSON ({e})") from None
    if not isinstance(config, dict) or str(config.get("peft_type", "")).upper() != "LORA":
        raise invalid(f"{ADAPTER_CONFIG} is not a LoRA adapter's (peft_type "
                      f"{config.get('peft_type') if isinstance(config, dict) else None!r}, not 'LORA')")
    weights = next((root / w for w in ADAPTER_WEIGHTS if (root / w).is_file()), None)
    if weights is None:
        raise invalid(f"no adapter weights ({' or '.join(ADAPTER_WEIGHTS)})")
    shapes = adapter_shapes(weights)
    if not shapes:
        raise invalid(f"{weights.name} is not a readable weights file (truncated, or a Git LFS pointer?)")
    ranks = [s[0] for n, s in shapes.items() if n.endswith(".lora_A.weight") and s]
    if not ranks:
        raise invalid(f"{weights.name} holds no LoRA matrices (no *.lora_A.weight)")
    base = _base_shapes(model_dir)
    if base:
        problems = _lora_mismatches(shapes, base)
        if problems:
            more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
            raise invalid(f"the adapter does not fit the base model at {model_dir} (trained for another base?): "
                          f"{'; '.join(problems[:3])}{more}")
    else:
        log.warning("model.lora.ref %s: the base model has no safetensors weights; adapter shapes not checked", ref)
    base_name = config.get("base_model_name_or_path")
    targets = config.get("target_modules") or ()
    return AdapterInfo(rank=max(ranks), target_modules=tuple([targets] if isinstance(targets, str) else targets),
                       base_model_name_or_path=base_name if isinstance(base_name, str) else None,
                       weights=weights.name)


def merged_dir(cache_root: str, model_hash: str, adapter_hash: str) -> Path:
    """Where the merge of this model with this adapter lives: keyed by both folders' content."""
    key = hashlib.sha256(f"{model_hash}:{adapter_hash}".encode()).hexdigest()[:16]
    return Path(cache_root) / "merged" / key


def _base_dtype(model_dir: str):
    import torch

    try:
        config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = {}
    name = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    return getattr(torch, name, torch.float32)


def merge_adapter(model_dir: str, adapter_dir: str, dest: Path, *, trust_remote_code: bool = False,
                  record: dict | None = None) -> bool:
    """Merges the adapter into the base model at ``dest`` (weights, config, the base's tokenizer and chat
    template); returns True on a cache hit (``dest`` complete already, nothing done).

    The merge runs in float32 and is saved in the base's dtype: W + BA is rounded once, as close to what a
    served adapter computes as the dtype allows. It needs the model in float32 in RAM (4 bytes a parameter)."""
    if (dest / MERGED_RECORD).is_file():
        return True
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    dtype = _base_dtype(model_dir)
    log.info("merging adapter %s into %s -> %s", adapter_dir, model_dir, dest)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, trust_remote_code=trust_remote_code)
    merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload().to(dtype)
    tmp = dest.with_name(f"{dest.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    merged.save_pretrained(tmp, safe_serialization=True)
    # The tokenizer, chat template, generation config and any code files come from the base as they are
    for f in Path(model_dir).iterdir():
        if (tmp / f.name).exists() or f.name.startswith(".") or f.name.endswith((*_WEIGHT_FILES, ".index.json")):
            continue
        if f.is_dir():  # additional_chat_templates/, remote code packages
            shutil.copytree(f, tmp / f.name)
        else:
            shutil.copy2(f, tmp / f.name)
    (tmp / MERGED_RECORD).write_text(json.dumps(record or {}, indent=1))
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.rename(tmp, dest)
    except OSError:  # another fetch merged the same pair meanwhile: its folder is as good
        shutil.rmtree(tmp, ignore_errors=True)
        if not (dest / MERGED_RECORD).is_file():
            raise
    return False
