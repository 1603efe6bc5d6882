"""LMDeploy behind the engine interface (PyTorch engine; TurboMind with ``engine.extra.backend: turbomind``).

LMDeploy refuses CPU devices, so this engine runs on GPU machines only (docs/benchmarks.md has what was
measured on an H200). Requests stream in the way they do for vLLM: the pipeline's own event loop runs one
coroutine per request (``AsyncEngine.preprocess`` with the row's token ids, then ``generate``), at most a
window of them in flight, and results come back in completion order. Token ids go in as they are, so both
engines see the same prompt tokens, and each row keeps its own ``max_tokens``.
"""
from __future__ import annotations

import asyncio
import queue
import time
from collections.abc import Iterable, Iterator

from batch_llm.engines.base import Engine, EngineInfo, EngineStartError, GenRequest, GenResult, \
    classify_start_failure, stream_requests


class LmdeployEngine(Engine):
    kind = "lmdeploy"

    def start(self) -> EngineInfo:
        t0 = time.perf_counter()
        c = self.cfg
        try:
            import lmdeploy
            from lmdeploy import PytorchEngineConfig, TurbomindEngineConfig, pipeline

            backend = c.extra.get("backend", "pytorch")
            # cache_max_entry_count is LMDeploy's share of free GPU memory for the KV cache.
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

    def _gen_config(self, max_tokens: int | None):
        from lmdeploy import GenerationConfig

        s = self.sampling
        return GenerationConfig(max_new_tokens=min(max_tokens or s.max_tokens, s.max_tokens),
                                temperature=s.temperature or 1e-6, top_p=s.top_p, do_sample=s.temperature > 0,
                                random_seed=s.seed, stop_words=s.stop or None, ignore_eos=s.ignore_eos)

    def generate(self, requests: Iterable[GenRequest]) -> Iterator[GenResult]:
        engine = self.pipe.async_engine
        loop = self.pipe.internal_thread.loop
        done: queue.Queue[GenResult] = queue.Queue()
        configs: dict[int | None, object] = {}

        async def one(req: GenRequest) -> None:
            out = None
            try:
                gen = configs.get(req.max_tokens) or configs.setdefault(req.max_tokens, self._gen_config(req.max_tokens))
                pre = await engine.preprocess(None, self.pipe.session_mgr.get(), gen_config=gen,
                                              input_ids=list(req.prompt_token_ids), do_preprocess=False)
                async for part in engine.generate(pre, stream_response=False):
                    r = part.to_response(0)
                    out = out.extend(r) if out else r
                if out is None or out.finish_reason == "error":
                    msg = getattr(out, "error_message", None) or "no output"
                    done.put(GenResult(req.key, prompt_tokens=len(req.prompt_token_ids),
                                       error=f"engine rejected the request: {msg}"))
                else:
                    done.put(GenResult(req.key, text=out.text, finish_reason=out.finish_reason,
                                       prompt_tokens=out.input_token_len, completion_tokens=out.generate_token_len))
            except Exception as e:  # noqa: BLE001 - one request's failure is that row's error, not the shard's
                done.put(GenResult(req.key, prompt_tokens=len(req.prompt_token_ids),
                                   error=f"engine rejected the request: {getattr(e, 'message', None) or e}"))

        def submit(req: GenRequest) -> None:
            asyncio.run_coroutine_threadsafe(one(req), loop)

        def collect() -> list[GenResult]:
            while True:
                try:
                    return [done.get(timeout=5)]
                except queue.Empty:
                    # A stopped loop cancels its requests: fail the shard (the retry resumes), do not wait forever
                    # and do not turn the rows into error rows.
                    if not self.pipe.internal_thread.thread.is_alive():
                        raise RuntimeError("LMDeploy's event loop stopped with requests in flight") from None

        yield from stream_requests(requests, window=max(4 * (self.cfg.max_num_seqs or 256), 512), submit=submit,
                                   collect=collect)

    def close(self) -> None:
        pipe = getattr(self, "pipe", None)
        if pipe is not None:
            pipe.close()
            self.pipe = None
