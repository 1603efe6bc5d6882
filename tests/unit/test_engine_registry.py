"""The engine registry: kinds resolve to the classes that registered themselves; the interface imports none."""
import subprocess
import sys

import pytest
from batch_llm.config import EngineConfig, SamplingConfig
from batch_llm.engines.registry import engine_class, make_engine


def test_interface_module_imports_no_concrete_engine():
    code = ("import sys, batch_llm.engines.base, batch_llm.engines.registry; "
            "print(sorted(m for m in sys.modules if m.endswith('_engine')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_kind_resolves_to_the_class_its_module_registered():
    from batch_llm.engines.transformers_engine import TransformersEngine

    assert engine_class("transformers") is TransformersEngine
    engine = make_engine("/nonexistent", EngineConfig(kind="transformers"), SamplingConfig())
    assert isinstance(engine, TransformersEngine) and engine.kind == "transformers"


def test_unknown_kind_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown engine kind 'tgi'.*lmdeploy, sglang, transformers, vllm"):
        engine_class("tgi")
