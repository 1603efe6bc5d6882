"""Plain transformers, the portable fallback: static batches of length-sorted prompts, left-padded.

This is what ms-swift's ``pt`` backend does; it runs wherever PyTorch runs, at a fraction of vLLM's
throughput (see docs/benchmarks.md).
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from itertools import islice

from batch_llm.engines.base import (
    Engine,
    EngineInfo,
    EngineStartError,
    GenRequest,
    GenResult,
    classify_start_failure,
    gc_paused_import,
)
from batch_llm.engines.probes import cpu_dtype, model_context_limit
from batch_llm.engines.registry import register_engine
from batch_llm.row_params import Sampling


@register_engine
class TransformersEngine(Engine):
    kind = "transformers"

    def start(self) -> EngineInfo:
        t0 = time.perf_counter()
        try:
            with gc_paused_import("transformers"):
                import torch
                import transformers
                from transformers import AutoModelForCausalLM, AutoTokenizer

            device = "cuda" if torch.cuda.is_available() else "cpu"
            dtype = {"auto": "auto", "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}.get(
                cpu_dtype(self.cfg.dtype, self.model_dir, on_gpu=device == "cuda"), "auto")
            self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=dtype,
                                                              trust_remote_code=self.trust_remote_code,
                                                              **self.cfg.extra).to(device).eval()
            self.tok = AutoTokenizer.from_pretrained(self.model_dir, trust_remote_code=self.trust_remote_code)
            self.tok.padding_side = "left"
            if self.tok.pad_token_id is None:
                self.tok.pad_token = self.tok.eos_token
            self.device = device
            torch.manual_seed(self.sampling.seed or 0)
        except Exception as e:  # noqa: BLE001
            memory, _ = classify_start_failure(str(e))
            raise EngineStartError(f"transformers failed to load the model: {e}", memory=memory) from e
        return EngineInfo(kind="transformers", version=transformers.__version__,
                          settings=dict(batch_size=self.cfg.batch_size, device=device, dtype=str(self.model.dtype),
                                        model_context_limit=model_context_limit(self.model_dir),
                                        trust_remote_code=self.trust_remote_code),
                          start_seconds=time.perf_counter() - t0)

    def generate(self, requests: Iterable[GenRequest]) -> Iterator[GenResult]:
        it = iter(requests)
        gc_eos = self.model.generation_config.eos_token_id
        eos = {self.tok.eos_token_id, *(gc_eos if isinstance(gc_eos, list) else [gc_eos])} - {None}
        while batch := list(islice(it, self.cfg.batch_size)):
            # One generate() call samples every row alike: rows are batched with rows of the same sampling
            # (length limits and stop strings are applied per row after it).
            groups: dict[tuple, list[tuple[GenRequest, Sampling]]] = {}
            for r in batch:
                s = self.sampling_for(r)
                groups.setdefault((s.temperature, s.top_p, s.seed, s.ignore_eos, s.top_k, s.min_p, s.repetition_penalty,
                                   s.stop_token_ids), []).append((r, s))
            for group in groups.values():
                yield from self._generate_group(group, eos)

    def _generate_group(self, group: list[tuple[GenRequest, Sampling]], eos: set) -> Iterator[GenResult]:
        import torch

        first = group[0][1]
        width = max(len(r.prompt_token_ids) for r, _ in group)
        pad = self.tok.pad_token_id
        ids = torch.tensor([[pad] * (width - len(r.prompt_token_ids)) + r.prompt_token_ids for r, _ in group],
                           device=self.device)
        mask = torch.tensor([[0] * (width - len(r.prompt_token_ids)) + [1] * len(r.prompt_token_ids)
                             for r, _ in group], device=self.device)
        gen = dict(max_new_tokens=max(s.max_tokens for _, s in group), pad_token_id=pad,
                   do_sample=first.temperature > 0)
        if first.temperature > 0:
            gen.update(temperature=first.temperature, top_p=first.top_p)
            # set only where asked: unset keeps the model's generation_config (as before these keys existed)
            gen.update({k: v for k, v in (("top_k", first.top_k), ("min_p", first.min_p)) if v})
            if first.seed is not None:
                torch.manual_seed(first.seed)
        if first.repetition_penalty != 1.0:  # applies to greedy decoding too, as in vLLM
            gen.update(repetition_penalty=first.repetition_penalty)
        stop_ids = set(first.stop_token_ids)
        if first.ignore_eos:
            gen.update(eos_token_id=sorted(stop_ids) or None)
        elif stop_ids:
            gen.update(eos_token_id=sorted(eos | stop_ids))
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=mask, **gen)
        for (r, s), row in zip(group, out[:, width:].tolist()):
            row = row[:s.max_tokens]
            n, reason, counted = len(row), "length", len(row)
            for i, t in enumerate(row):
                if t in stop_ids:  # kept in the output, as vLLM keeps a stop token id (special ones decode to "")
                    n, reason, counted = i + 1, "stop", i + 1
                    break
                if t in eos and not s.ignore_eos:
                    n, reason, counted = i, "stop", i + 1
                    break
            text = self.tok.decode(row[:n], skip_special_tokens=True)
            for stop in s.stop:
                if stop in text:
                    end = text.index(stop) + (len(stop) if s.include_stop_str_in_output else 0)
                    text, reason = text[:end], "stop"
            yield GenResult(r.key, text=text, finish_reason=reason, prompt_tokens=len(r.prompt_token_ids),
                            completion_tokens=counted)

    def close(self) -> None:
        self.model = None
