"""A toy engine for tests/unit/test_engine_capabilities.py: what adding an engine takes is one module (this: a
class registered under its kind) plus one row of the capability table (the test registers it, naming this
module; the registry imports the module when a shard first asks for the kind). It answers with each prompt's
token count."""
from __future__ import annotations

from collections.abc import Iterable, Iterator

from batch_llm.engines.base import Engine, EngineInfo, GenRequest, GenResult
from batch_llm.engines.registry import register_engine


@register_engine
class ToyEngine(Engine):
    kind = "toy"

    def start(self) -> EngineInfo:
        return EngineInfo(kind=self.kind, version="0", settings={"max_num_seqs": self.cfg.max_num_seqs})

    def generate(self, requests: Iterable[GenRequest]) -> Iterator[GenResult]:
        for r in requests:
            s = self.sampling_for(r)
            yield GenResult(key=r.key, text=f"{len(r.prompt_token_ids)} tokens", finish_reason="stop",
                            prompt_tokens=len(r.prompt_token_ids), completion_tokens=min(2, s.max_tokens))
