"""Which engine class serves each ``engine.kind``: engines register themselves, the shard runner asks by kind.

An engine's module is imported only when a shard asks for its kind (importing vLLM costs ~15 s, LMDeploy does
not install on CPU machines), so the registry knows each kind's module by name from the capability table
(``config/capabilities.py``, one row per kind, importable without any engine), and each module registers its class
with :func:`register_engine` when it is imported. ``base.py`` (the interface) knows no concrete engine, so there
is no import circle.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, TypeVar

from batch_llm.config.capabilities import ENGINES, capabilities, unregister_capabilities

__all__ = ["engine_class", "make_engine", "register_engine", "unregister_engine"]

if TYPE_CHECKING:
    from batch_llm.config import EngineConfig, SamplingConfig
    from batch_llm.engines.base import Engine

E = TypeVar("E", bound="type[Engine]")

_registered: dict[str, type[Engine]] = {}


def register_engine(cls: E) -> E:
    """Class decorator: makes ``cls`` the engine of ``cls.kind``, a kind of the capability table."""
    kind = getattr(cls, "kind", None)
    if not kind:
        raise TypeError(f"{cls.__name__} has no `kind` to register under")
    if kind not in ENGINES:
        raise TypeError(f"{cls.__name__}: engine kind {kind!r} has no row in the capability table "
                        "(batch_llm.config.capabilities: add one or call register_capabilities first)")
    _registered[kind] = cls
    return cls


def unregister_engine(kind: str) -> None:
    """Forgets ``kind``: its class and its capability row (tests that add a toy engine clean up with it)."""
    _registered.pop(kind, None)
    unregister_capabilities(kind)


def engine_class(kind: str) -> type[Engine]:
    """The registered class of ``kind``, importing its module on first use."""
    if kind not in _registered:
        module = capabilities(kind).module  # ValueError naming the known kinds
        importlib.import_module(module)
        if kind not in _registered:
            raise RuntimeError(f"{module} did not register an engine of kind {kind!r}")
    return _registered[kind]


def make_engine(model_dir: str, engine: EngineConfig, sampling: SamplingConfig, *,
                trust_remote_code: bool = False, lora_dir: str | None = None) -> Engine:
    """An engine of ``engine.kind`` for the model in ``model_dir`` (not started: call ``start()``); ``lora_dir``:
    a LoRA adapter it serves on every request (an engine that cannot serve one refuses it)."""
    cls = engine_class(engine.kind)
    if lora_dir is not None and not capabilities(engine.kind).lora_served:
        raise ValueError(f"engine {engine.kind} cannot serve a LoRA adapter unmerged ({lora_dir}); "
                         "set model.lora.merge: true")
    kwargs = {"lora_dir": lora_dir} if lora_dir is not None else {}
    return cls(model_dir, engine, sampling, trust_remote_code=trust_remote_code, **kwargs)
