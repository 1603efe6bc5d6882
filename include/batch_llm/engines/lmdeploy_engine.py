"""LMDeploy behind the engine interface (PyTorch engine; TurboMind when its CUDA 12 libraries exist).

LMDeploy refuses CPU devices, so this engine runs on GPU machines only (see docs/benchmarks.md for what was
measured on an H200). Prompts go in as the already-rendered chat text (``do_preprocess=False``).
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from itertools import islice

from batch_llm.engines.base import Engine, EngineInfo, EngineStartError, GenRequest, GenResult, \
    classify_start_failure


class LmdeployEngine(Engine):
    kind = "lmdeploy"

    def start(self) -> EngineInfo:
        t0 = time.perf_counter()
        c = self.cfg
        try:
            import lmdeploy
            from lmdeploy import PytorchEngineConfig, TurbomindEngineConfig, pipeline

            backend = c.extra.get("backend", "pytorch")
            common = dict(session_len=c.max_model_len, max_batch_size=c.max_num_seqs or 256,
                          cache_max_entry_count=c.gpu_memory_utilization, tp=c.tensor_parallel_size)
            if backend == "turbomind":
                bc = TurbomindEngineConfig(**common)
            else:
                bc = PytorchEngineConfig(dtype="auto" if c.dtype == "auto" else c.dtype, eager_mode=c.enforce_eager,
                                         **common)
            self.pipe = pipeline(self.model_dir, backend_config=bc, log_level="WARNING")
        except Exception as e:  # noqa: BLE001
            memory, _ = classify_start_failure(str(e))
            raise EngineStartError(f"LMDeploy failed to start: {e}", memory=memory) from e
        return EngineInfo(kind="lmdeploy", version=lmdeploy.__version__, settings=dict(backend=backend, **common),
                          start_seconds=time.perf_counter() - t0)

    def generate(self, requests: Iterable[GenRequest]) -> Iterator[GenResult]:
        from lmdeploy import GenerationConfig

        s = self.sampling
        gen = GenerationConfig(max_new_tokens=s.max_tokens, temperature=s.temperature or 1e-6, top_p=s.top_p,
                               do_sample=s.temperature > 0, random_seed=s.seed, stop_words=s.stop or None,
                               ignore_eos=s.ignore_eos)
        it = iter(requests)
        # LMDeploy batches internally; feeding it large slices keeps its scheduler full.
        while batch := list(islice(it, 4 * (self.cfg.max_num_seqs or 256))):
            outs = self.pipe([r.prompt_text for r in batch], gen_config=gen, do_preprocess=False)
            for r, o in zip(batch, outs):
                yield GenResult(r.key, text=o.text, finish_reason=o.finish_reason,
                                prompt_tokens=o.input_token_len, completion_tokens=o.generate_token_len)

    def close(self) -> None:
        pipe = getattr(self, "pipe", None)
        if pipe is not None:
            pipe.close()
            self.pipe = None
