"""vLLM's multimodal processor keeps the Hugging Face processor it builds (engines.vllm_engine.keep_hf_processor).

The real engine is checked in tests/system/test_vision_language.py (the manifest says the processor was kept);
this pins the keeping itself: once per set of arguments, arguments that cannot be a key built as vLLM would, and a
vLLM without the object left as it is."""
from __future__ import annotations

from types import SimpleNamespace

from batch_llm.engines.vllm_engine import keep_hf_processor


def _llm(info) -> SimpleNamespace:
    return SimpleNamespace(llm_engine=SimpleNamespace(renderer=SimpleNamespace(mm_processor=SimpleNamespace(info=info))))


class _Info:
    def __init__(self) -> None:
        self.built: list[dict] = []

    def get_hf_processor(self, **kwargs):
        self.built.append(kwargs)
        return object()


def test_the_processor_is_built_once_per_set_of_arguments():
    info = _Info()
    assert keep_hf_processor(_llm(info)) is True
    first = info.get_hf_processor()
    assert info.get_hf_processor() is first
    sized = info.get_hf_processor(max_pixels=200_704)
    assert sized is not first and info.get_hf_processor(max_pixels=200_704) is sized
    assert info.built == [{}, {"max_pixels": 200_704}]


def test_arguments_that_cannot_be_a_key_build_a_processor_each_time():
    info = _Info()
    keep_hf_processor(_llm(info))
    a, b = info.get_hf_processor(size={"shortest_edge": 56}), info.get_hf_processor(size={"shortest_edge": 56})
    assert a is not b and len(info.built) == 2


def test_an_engine_without_a_multimodal_processor_is_left_as_it_is():
    assert keep_hf_processor(_llm(None)) is False
    assert keep_hf_processor(SimpleNamespace(llm_engine=SimpleNamespace())) is False
