"""Which engine class serves each ``engine.kind``: engines register themselves, the shard runner asks by kind.

An engine's module is imported only when a shard asks for its kind (importing vLLM costs ~15 s, LMDeploy does
not install on CPU machines), so the registry knows each built-in kind's module by name, and each module
registers its class with :func:`register_engine` when it is imported. ``base.py`` (the interface) knows no
concrete engine, so there is no import circle.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from batch_llm.config import EngineConfig, SamplingConfig
    from batch_llm.engines.base import Engine

E = TypeVar("E", bound="type[Engine]")

BUILTIN_ENGINE_MODULES = {
    "vllm": "batch_llm.engines.vllm_engine",
    "transformers": "batch_llm.engines.transformers_engine",
    "lmdeploy": "batch_llm.engines.lmdeploy_engine",
}
_registered: dict[str, type[Engine]] = {}


def register_engine(cls: E) -> E:
    """Class decorator: makes ``cls`` the engine of ``cls.kind``."""
    kind = getattr(cls, "kind", None)
    if not kind:
        raise TypeError(f"{cls.__name__} has no `kind` to register under")
    _registered[kind] = cls
    return cls


def engine_class(kind: str) -> type[Engine]:
    """The registered class of ``kind``, importing its module on first use."""
    if kind not in _registered:
        module = BUILTIN_ENGINE_MODULES.get(kind)
        if module is None:
            raise ValueError(f"unknown engine kind {kind!r} (known: {', '.join(sorted(BUILTIN_ENGINE_MODULES))})")
        importlib.import_module(module)
        if kind not in _registered:
            raise RuntimeError(f"{module} did not register an engine of kind {kind!r}")
    return _registered[kind]


def make_engine(model_dir: str, engine: EngineConfig, sampling: SamplingConfig, *,
                trust_remote_code: bool = False, lora_dir: str | None = None) -> Engine:
    """An engine of ``engine.kind`` for the model in ``model_dir`` (not started: call ``start()``); ``lora_dir``:
    a LoRA adapter it serves on every request (an engine that cannot serve one refuses it)."""
    cls = engine_class(engine.kind)
    if lora_dir is not None and not cls.serves_lora:
        raise ValueError(f"engine {engine.kind} cannot serve a LoRA adapter unmerged ({lora_dir}); "
                         "set model.lora.merge: true")
    kwargs = {"lora_dir": lora_dir} if lora_dir is not None else {}
    return cls(model_dir, engine, sampling, trust_remote_code=trust_remote_code, **kwargs)
