"""LMDeploy behind the engine interface (PyTorch engine; TurboMind with ``engine.extra.backend: turbomind``).

LMDeploy refuses CPU devices, so this engine runs on GPU machines only (docs/benchmarks.md has what was
measured on an H200). Requests stream in the way they do for vLLM: the pipeline's own event loop runs one
coroutine per request (``AsyncEngine.preprocess`` with the row's token ids, then ``generate``), at most a
window of them in flight, and results come back in completion order. Token ids go in as they are, so both
engines see the same prompt tokens, and each row keeps its own sampling parameters.
"""
from __future__ import annotations

import asyncio
import dataclasses
import queue
import time
from collections.abc import Iterable, Iterator

from batch_llm.engines.base import (
    Engine,
    EngineFailed,
    EngineInfo,
    EngineStartError,
    GenRequest,
    GenResult,
    classify_start_failure,
    gc_paused_import,
    stream_requests,
)
from batch_llm.engines.lmdeploy_config import lmdeploy_backend_config, lmdeploy_request_refusal
from batch_llm.engines.registry import register_engine
from batch_llm.host.probes import model_context_limit
from batch_llm.rows.params import Sampling


@register_engine
class LmdeployEngine(Engine):
    kind = "lmdeploy"

    def start(self) -> EngineInfo:
        t0 = time.perf_counter()
        # Every engine key is mapped onto the backend's config or was refused when the config loaded
        # (lmdeploy_config.py); cache_max_entry_count is LMDeploy's share of *free* GPU memory for the KV cache.
        try:
            backend, kwargs = lmdeploy_backend_config(self.cfg)
            with gc_paused_import("lmdeploy"):
                import lmdeploy
                from lmdeploy import PytorchEngineConfig, TurbomindEngineConfig, pipeline

            cls = TurbomindEngineConfig if backend == "turbomind" else PytorchEngineConfig
            unknown = sorted(set(kwargs) - {f.name for f in dataclasses.fields(cls)})
            if unknown:  # another LMDeploy version than the one the mapping was written for
                raise EngineStartError(f"LMDeploy {lmdeploy.__version__}'s {cls.__name__} has no field(s) {unknown} "
                                       "(set through engine.extra or mapped from the engine section)")
            self.pipe = pipeline(self.model_dir, backend_config=cls(**kwargs), log_level="WARNING",
                                 trust_remote_code=self.trust_remote_code)
        except EngineStartError:
            raise
        except Exception as e:  # noqa: BLE001
            memory, _ = classify_start_failure(str(e))
            raise EngineStartError(f"LMDeploy failed to start: {e}", memory=memory, output=str(e)) from e
        return EngineInfo(kind="lmdeploy", version=lmdeploy.__version__,
                          settings=dict(backend=backend, **kwargs, model_context_limit=model_context_limit(
                              self.model_dir), trust_remote_code=self.trust_remote_code),
                          start_seconds=time.perf_counter() - t0)

    def _gen_config(self, s: Sampling):
        from lmdeploy import GenerationConfig

        # top_k and min_p only where set: unset keeps LMDeploy's defaults (as before these keys existed)
        extra = {k: v for k, v in (("top_k", s.top_k), ("min_p", s.min_p)) if v}
        return GenerationConfig(max_new_tokens=s.max_tokens, temperature=s.temperature or 1e-6, top_p=s.top_p,
                                do_sample=s.temperature > 0, random_seed=s.seed, stop_words=list(s.stop) or None,
                                ignore_eos=s.ignore_eos, repetition_penalty=s.repetition_penalty,
                                stop_token_ids=list(s.stop_token_ids) or None, **extra)

    def generate(self, requests: Iterable[GenRequest]) -> Iterator[GenResult]:  # noqa: C901
        engine = self.pipe.async_engine
        loop = self.pipe.internal_thread.loop
        done: queue.Queue[GenResult | BaseException] = queue.Queue()
        configs: dict[Sampling, object] = {}  # one GenerationConfig per distinct resolved sampling

        async def one(req: GenRequest) -> None:
            out = None
            try:
                s = self.sampling_for(req)
                gen = configs.get(s) or configs.setdefault(s, self._gen_config(s))
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
            except Exception as e:  # noqa: BLE001 - classified: the request's fault (a row error) or the engine's
                if not lmdeploy_request_refusal(e):
                    done.put(e)  # the engine failed: the shard fails and its retry resumes
                    return
                done.put(GenResult(req.key, prompt_tokens=len(req.prompt_token_ids),
                                   error=f"engine rejected the request: {getattr(e, 'message', None) or e}"))
            except BaseException as e:  # cancelled: the engine is stopping
                done.put(e)
                raise

        def submit(req: GenRequest) -> None:
            asyncio.run_coroutine_threadsafe(one(req), loop)

        def collect() -> list[GenResult]:
            while True:
                try:
                    item = done.get(timeout=5)
                except queue.Empty:
                    # A stopped loop cancels its requests: fail the shard (the retry resumes), do not wait forever
                    # and do not turn the rows into error rows.
                    if not self.pipe.internal_thread.thread.is_alive():
                        raise EngineFailed("LMDeploy's event loop stopped with requests in flight") from None
                    continue
                if isinstance(item, BaseException):
                    raise EngineFailed(f"LMDeploy's engine failed mid-shard: {type(item).__name__}: "
                                       f"{getattr(item, 'message', None) or item}") from item
                return [item]

        yield from stream_requests(requests, window=max(4 * (self.cfg.max_num_seqs or 256), 512), submit=submit,
                                   collect=collect)

    def close(self) -> None:
        pipe = getattr(self, "pipe", None)
        if pipe is not None:
            pipe.close()
            self.pipe = None
