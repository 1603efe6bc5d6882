"""SGLang behind the engine interface: its offline engine (``sglang.Engine``) in the worker process.

Requests stream in as they do for vLLM and LMDeploy: one ``async_generate`` per request (the row's token ids,
its own sampling parameters) on the engine's event loop, at most a window of them in flight, results in completion
order; the loop runs while the shard runner waits for the next results. A request SGLang refuses (its checks raise
``ValueError``) is that row's error; anything else fails the shard, whose retry resumes from the committed chunks.
A request for n > 1 samples is n requests (seeds seed, seed + 1, ...), so that seeded samples differ. How the engine
section maps onto SGLang's arguments is ``sglang_config.py``; what it serves is its capability row.
"""
from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from batch_llm.engines.base import (
    Engine,
    EngineFailed,
    EngineInfo,
    EngineStartError,
    GenRequest,
    GenResult,
    Sample,
    TokenLogprob,
    TopLogprob,
    classify_start_failure,
    gc_paused_import,
    stream_requests,
)
from batch_llm.engines.output_capture import OutputTail
from batch_llm.engines.registry import register_engine
from batch_llm.engines.sglang_config import (
    LORA_NAME,
    deterministic_inference,
    row_json_schema,
    sampling_params,
    schema_text,
    seeded_sampling_refusal,
    sglang_engine_args,
    sglang_request_refusal,
)
from batch_llm.host.probes import cpu_dtype, model_context_limit
from batch_llm.rows.params import Sampling

# SGLang 0.5.17, model_executor/pool_configurator.py: the weights leave no KV pool at this memory share; SGLang asks
# for a larger share, so a smaller one (the memory back-off) cannot help.
_NEEDS_LARGER_SHARE = re.compile(r"Please try to increase --mem-fraction-static")


def classify_sglang_start_failure(text: str) -> tuple[bool, str | None]:
    """(is it a memory failure a smaller setting may fix?, a hint for the message) for the text of a failed start
    (the exception chain and the tail of SGLang's processes' output)."""
    if _NEEDS_LARGER_SHARE.search(text):
        return False, ("the weights leave no room for a KV pool at this memory share: raise "
                       "engine.gpu_memory_utilization (SGLang's mem_fraction_static), or use more GPUs "
                       "(engine.tensor_parallel_size) or a smaller or quantized model")
    memory, _ = classify_start_failure(text)
    return memory, None


_FAILED_CHILDREN: list[int] = []


def _child_failed(signum, frame) -> None:  # noqa: ARG001 - a signal handler's signature
    """SGLang's processes send SIGQUIT to the engine's process when one of them fails. SGLang's own handler ends the
    whole process tree, this process included, which would leave no start failure to classify (the memory back-off
    reads it). This one ends only SGLang's processes; the engine start then raises, with the cause in the output.
    Module-level: SGLang pickles its arguments into the processes it spawns."""
    _FAILED_CHILDREN.append(signum)
    try:
        from sglang.srt.utils import kill_process_tree

        kill_process_tree(os.getpid(), include_parent=False)
    except Exception:  # noqa: BLE001 - best effort: the start fails either way
        pass


@register_engine
class SglangEngine(Engine):
    kind = "sglang"

    def start(self) -> EngineInfo:
        t0 = time.perf_counter()
        # Log-probabilities of the model's own distribution, before temperature (as vLLM returns them); read by
        # SGLang's sampler in the processes it spawns
        os.environ["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "1"
        try:
            with gc_paused_import("sglang"):
                import sglang
                import torch
                from sglang.srt.entrypoints.engine import Engine as SglEngine
                from sglang.srt.server_args import ServerArgs
        except Exception as e:  # noqa: BLE001 - an engine that cannot even be imported
            raise EngineStartError(f"SGLang failed to start: {type(e).__name__}: {e}", output=str(e)) from e
        on_gpu = torch.cuda.is_available()
        fields = frozenset(f.name for f in ServerArgs.__dataclass_fields__.values())
        try:
            args = self.constructor_args(fields, on_gpu=on_gpu)
        except ValueError as e:
            raise EngineStartError(f"SGLang cannot run this engine section: {e}") from e
        unknown = sorted(set(args) - fields)
        if unknown:  # engine.extra naming a field this SGLang lacks
            raise EngineStartError(f"SGLang {sglang.__version__}'s ServerArgs has no field(s) {unknown} (engine.extra)")
        args["custom_sigquit_handler"] = _child_failed
        _FAILED_CHILDREN.clear()
        tail = OutputTail()
        try:
            with tail.capture():
                self.engine = SglEngine(**args)
        except Exception as e:  # noqa: BLE001 - classified and re-raised
            text = f"{type(e).__name__}: {e}\n{tail.text()}"
            memory, hint = classify_sglang_start_failure(text)
            raise EngineStartError(f"SGLang failed to start: {e}" + (f" ({hint})" if hint else ""), memory=memory,
                                   output=text) from e
        return EngineInfo(kind="sglang", version=sglang.__version__, settings=self._settings(args, on_gpu),
                          start_seconds=time.perf_counter() - t0)

    def constructor_args(self, fields: frozenset[str] | None, *, on_gpu: bool) -> dict:
        """The keyword arguments of ``sglang.Engine`` for this engine section (``sglang_engine_args``), without the
        start-failure handler the worker adds; ``fields``: the installed ``ServerArgs``' field names. Also what a
        plain ``sglang.Engine`` script with the stage's settings passes (bench/inference.py's raw mode for SGLang).
        ValueError naming the keys SGLang cannot honour."""
        self.deterministic = deterministic_inference(self.cfg, self.sampling)
        lora = None
        if self.lora_dir is not None:
            from batch_llm.host.probes import adapter_rank

            lora = (self.lora_dir, adapter_rank(self.lora_dir))
        return sglang_engine_args(self.cfg, self.model_dir, seed=self.sampling.seed,
                                  trust_remote_code=self.trust_remote_code,
                                  dtype=cpu_dtype(self.cfg.dtype, self.model_dir, on_gpu=on_gpu),
                                  deterministic=self.deterministic, fields=fields, on_gpu=on_gpu, lora=lora)

    def _settings(self, args: dict, on_gpu: bool) -> dict:
        """What the engine started with, for the manifest: SGLang's server arguments as its schedulers resolved them
        (the ones in this process keep the nulls they were given) and its KV pool."""
        info = self.engine.get_server_info()
        state = (info.get("internal_states") or [{}])[0]
        self.max_running = state.get("effective_max_running_requests_per_dp") or info.get("max_running_requests")
        decode = (info.get("cuda_graph_config") or {}).get("decode") or {}
        graphs_off = bool(info.get("disable_cuda_graph")) or decode.get("backend") == "disabled"
        return dict(max_model_len=self.max_model_len, max_num_seqs=self.max_running,
                    max_total_num_tokens=info.get("max_total_num_tokens"),
                    gpu_memory_utilization=info.get("mem_fraction_static"),
                    chunked_prefill_size=info.get("chunked_prefill_size"),
                    cuda_graph_max_bs=None if graphs_off else decode.get("max_bs", info.get("cuda_graph_max_bs")),
                    enforce_eager=graphs_off, enable_prefix_caching=not info.get("disable_radix_cache"),
                    dtype=str(info.get("dtype")), kv_cache_dtype=str(info.get("kv_cache_dtype")),
                    tensor_parallel_size=info.get("tp_size"), device=str(info.get("device")),
                    attention_backend=info.get("attention_backend"), sampling_backend=info.get("sampling_backend"),
                    grammar_backend=info.get("grammar_backend"),
                    deterministic_inference=bool(info.get("enable_deterministic_inference")),
                    model_context_limit=model_context_limit(self.model_dir),
                    trust_remote_code=self.trust_remote_code,
                    lora=dict(path=self.lora_dir, max_lora_rank=args.get("max_lora_rank")) if self.lora_dir else None,
                    on_gpu=on_gpu)

    @property
    def max_model_len(self) -> int | None:
        engine = getattr(self, "engine", None)
        return engine.tokenizer_manager.context_len if engine is not None else self.cfg.max_model_len

    def _json_schema_for(self, req: GenRequest, s: Sampling) -> str | None:
        row = row_json_schema(s.response_format, self.sampling.guided_length_bounds)
        if row is not None:
            return row
        under = req.guided if req.guided is not None else self.sampling.guided_decoding is True
        if self.sampling.output_schema is None or not self.sampling.guided_decoding or not under:
            return None
        return self._pipeline_schema

    def generate(self, requests: Iterable[GenRequest]) -> Iterator[GenResult]:
        engine = self.engine
        loop = engine.loop
        self._pipeline_schema = (schema_text(self.sampling.output_schema, self.sampling.guided_length_bounds)
                                 if self.sampling.output_schema is not None else None)
        pending: set[asyncio.Task] = set()

        def submit(req: GenRequest) -> GenResult | None:
            s = self.sampling_for(req)
            refusal = seeded_sampling_refusal(s, deterministic=self.deterministic)
            if refusal is not None:
                return GenResult(req.key, prompt_tokens=len(req.prompt_token_ids), error=refusal)
            pending.add(loop.create_task(self._one(req, s)))
            return None

        def collect() -> list[GenResult]:
            while True:
                done, _ = loop.run_until_complete(asyncio.wait(pending, timeout=5,
                                                               return_when=asyncio.FIRST_COMPLETED))
                if done:
                    break
                if _FAILED_CHILDREN or not self._children_alive():
                    raise EngineFailed("SGLang's scheduler or detokenizer process ended with requests in flight")
            results = []
            for task in done:
                pending.discard(task)
                try:
                    results.append(task.result())
                except Exception as e:  # noqa: BLE001 - not the request's fault: the engine's
                    raise EngineFailed(f"SGLang's engine failed mid-shard: {type(e).__name__}: "
                                       f"{getattr(e, 'detail', None) or e}") from e
            return results

        window = max(4 * (getattr(self, "max_running", None) or self.cfg.max_num_seqs or 256), 512)
        try:
            yield from stream_requests(requests, window=window, submit=submit, collect=collect)
        finally:
            for task in pending:
                task.cancel()

    async def _one(self, req: GenRequest, s: Sampling) -> GenResult:
        """One request: its samples as SGLang requests, their outputs as one result (or the row's error)."""
        schema = self._json_schema_for(req, s)
        want = s.logprobs
        calls = [self.engine.async_generate(input_ids=list(req.prompt_token_ids),
                                            sampling_params=sampling_params(s, json_schema=schema,
                                                                            seed=self._sample_seed(s, i)),
                                            return_logprob=want is not None, top_logprobs_num=want or 0,
                                            lora_path=LORA_NAME if self.lora_dir is not None else None)
                 for i in range(s.n)]
        try:
            outs = await asyncio.gather(*calls)
        except Exception as e:  # noqa: BLE001 - classified: the request's fault (a row error) or the engine's
            if not sglang_request_refusal(e):
                raise
            return GenResult(req.key, prompt_tokens=len(req.prompt_token_ids),
                             error=f"engine rejected the request: {getattr(e, 'detail', None) or e}")
        return gen_result(req.key, outs, want, many=s.n > 1, decode=self._decode_token)

    def _decode_token(self, tid: int) -> str:
        # Engine.async_generate has no return_text_in_logprobs: a candidate's text is decoded here, one token at a
        # time, as SGLang's tokenizer manager decodes it when asked
        return self.engine.tokenizer_manager.tokenizer.decode([tid])

    def _sample_seed(self, s: Sampling, i: int) -> int | None:
        """Sample ``i``'s seed: the row's seed + i, where SGLang honours seeds (deterministic inference) and the
        row samples; a fresh one for an unseeded sampled row there (SGLang would seed every sample alike)."""
        if not self.deterministic or s.temperature <= 0:
            return None
        return s.seed + i if s.seed is not None else random.getrandbits(62)

    def _children_alive(self) -> bool:
        import psutil

        for pid in self.engine.get_all_child_pids():
            try:
                if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                    return False
            except psutil.NoSuchProcess:
                return False
        return True

    def close(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            try:
                engine.shutdown()
            except Exception:  # noqa: BLE001 - best effort; the worker's process group is ended anyway
                pass
            self.engine = None
        # SGLang's start leaves its SIGQUIT handler (ours) installed: back to the default for this process
        if signal.getsignal(signal.SIGQUIT) is _child_failed:
            signal.signal(signal.SIGQUIT, signal.SIG_DFL)


def gen_result(key: str, outs: list[dict], top_k: int | None, *, many: bool,
               decode: Callable[[int], str] = lambda tid: f"token_id:{tid}") -> GenResult:
    """One request's SGLang outputs (one per sample) as the engine interface's result: the first sample as ``text``,
    every sample (with ``top_k`` log-probabilities per token, when asked) in ``samples`` where the request asked for
    n > 1 or logprobs; ``decode`` gives a token's text where SGLang sent none. A sample SGLang aborted makes the row
    an error."""
    samples = []
    for out in outs:
        meta = out["meta_info"]
        reason = meta.get("finish_reason") or {}
        kind = reason.get("type") if isinstance(reason, dict) else reason
        if kind == "abort":
            return GenResult(key, prompt_tokens=meta.get("prompt_tokens", 0),
                             error=f"engine aborted the request: {reason.get('message', '')}".rstrip(": "))
        samples.append(Sample(text=out["text"], finish_reason=kind, completion_tokens=meta["completion_tokens"],
                              logprobs=token_logprobs(meta, top_k, decode) if top_k is not None else None))
    meta = outs[0]["meta_info"]
    first = samples[0]
    return GenResult(key, text=first.text, finish_reason=first.finish_reason, prompt_tokens=meta["prompt_tokens"],
                     completion_tokens=sum(x.completion_tokens for x in samples),
                     cached_prompt_tokens=meta.get("cached_tokens") or 0,
                     samples=tuple(samples) if many or top_k is not None else None)


def token_logprobs(meta: dict[str, Any], top_k: int,
                   decode: Callable[[int], str] = lambda tid: f"token_id:{tid}") -> tuple[TokenLogprob, ...]:
    """SGLang's ``output_token_logprobs`` ((logprob, token id, text) per generated token) and
    ``output_top_logprobs`` (a list of such per position, or None) as one ``TokenLogprob`` per token, its
    candidates most likely first."""
    chosen = meta.get("output_token_logprobs") or []
    tops = meta.get("output_top_logprobs") or [None] * len(chosen)
    out = []
    for (lp, tid, text), top in zip(chosen, tops):
        ranked = sorted(top or [], key=lambda c: -c[0])[:top_k]
        out.append(TokenLogprob(text if text is not None else decode(tid), lp,
                                tuple(TopLogprob(x if x is not None else decode(t), v) for v, t, x in ranked)))
    return tuple(out)
