"""Plain transformers, the portable fallback: static batches of length-sorted prompts, left-padded.

This is what ms-swift's ``pt`` backend does; it runs wherever PyTorch runs, at a fraction of vLLM's
throughput (see docs/benchmarks.md). A vision-language model (its config names a vision part) loads as
``AutoModelForImageTextToText`` with its processor: rows with images go through the processor (which puts each
image's tokens where the model wants them, as vLLM's does), batched with rows of the same sampling.
"""
from __future__ import annotations

import inspect
import time
from collections.abc import Iterable, Iterator
from itertools import islice
from typing import Any

from batch_llm.engines.base import (
    Engine,
    EngineCannotRun,
    EngineInfo,
    EngineStartError,
    GenRequest,
    GenResult,
    classify_start_failure,
    gc_paused_import,
)
from batch_llm.engines.registry import register_engine
from batch_llm.host.probes import cpu_dtype, model_context_limit, processor_kwargs_refusal
from batch_llm.rows.params import Sampling


@register_engine
class TransformersEngine(Engine):
    kind = "transformers"

    def start(self) -> EngineInfo:
        from batch_llm.io.images import model_takes_images

        t0 = time.perf_counter()
        if refusal := processor_kwargs_refusal(self.model_dir, self.cfg.mm_processor_kwargs):
            raise EngineCannotRun(refusal)
        vision = model_takes_images(self.model_dir)
        try:
            with gc_paused_import("transformers"):
                import torch
                import transformers
                from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

            device = "cuda" if torch.cuda.is_available() else "cpu"
            dtype = {"auto": "auto", "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}.get(
                cpu_dtype(self.cfg.dtype, self.model_dir, on_gpu=device == "cuda"), "auto")
            loader = AutoModelForImageTextToText if vision else AutoModelForCausalLM
            self.model = loader.from_pretrained(self.model_dir, dtype=dtype, trust_remote_code=self.trust_remote_code,
                                                **self.cfg.extra).to(device).eval()
            self.tok = AutoTokenizer.from_pretrained(self.model_dir, trust_remote_code=self.trust_remote_code)
            self.tok.padding_side = "left"
            if self.tok.pad_token_id is None:
                self.tok.pad_token = self.tok.eos_token
            self.processor: Any = None
            if vision:
                self.processor = AutoProcessor.from_pretrained(self.model_dir, trust_remote_code=self.trust_remote_code)
                self.processor.tokenizer = self.tok  # left padding, the pad token above
            # BLIP-2 and InstructBLIP put one image's query tokens before the prompt: the model would fill them from
            # the first of two images and drop the second without a word (other processors and models raise on a
            # mismatch, failing the row), so a row with more is refused here, as vLLM refuses it for these models
            self.images_per_prompt: int | None = 1 if getattr(self.processor, "num_query_tokens", None) else None
            self.text_model = _text_generator(self.model)
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
                                   s.stop_token_ids, self._special_tokens(r)), []).append((r, s))
            for key, group in groups.items():
                yield from self._generate_group(group, eos, key[-1])

    def _special_tokens(self, r: GenRequest) -> bool | None:
        """For a request with images, whether its token ids are its text tokenized with the tokenizer's special
        tokens (a completion prompt) or without (a rendered chat), so the processor tokenizes it the same way;
        None for a request without images (its token ids are used as they are)."""
        if not r.images:
            return None
        return self.tok(r.prompt_text, add_special_tokens=False)["input_ids"] != r.prompt_token_ids

    def _image_inputs(self, group: list[tuple[GenRequest, Sampling]], special: bool) -> dict:
        """The model's inputs for requests with images: the processor tokenizes each prompt text, puts its images'
        tokens in it and prepares the pixels (engine.mm_processor_kwargs), left-padded to one width."""
        inputs = self.processor(text=[r.prompt_text for r, _ in group], images=[list(r.images or []) for r, _ in group],
                                padding=True, add_special_tokens=special, return_tensors="pt",
                                **self.cfg.mm_processor_kwargs)
        return {k: v.to(self.device, dtype=self.model.dtype) if v.is_floating_point() else v.to(self.device)
                for k, v in inputs.items()}

    def _generate_group(self, group: list[tuple[GenRequest, Sampling]], eos: set, special: bool | None
                        ) -> Iterator[GenResult]:
        """One group of requests (``special``: its key's ``_special_tokens``, None for requests without images)."""
        import torch

        if special is not None:
            yield from self._generate_images(group, eos, special)
            return
        if self.text_model is None:
            for r, _ in group:
                yield GenResult(r.key, error=f"{type(self.model).__name__} generates only from images through "
                                              "transformers; this row has none (engine.kind: vllm takes both)")
            return
        pad = self.tok.pad_token_id
        width = max(len(r.prompt_token_ids) for r, _ in group)
        ids = torch.tensor([[pad] * (width - len(r.prompt_token_ids)) + r.prompt_token_ids for r, _ in group],
                           device=self.device)
        mask = torch.tensor([[0] * (width - len(r.prompt_token_ids)) + [1] * len(r.prompt_token_ids)
                             for r, _ in group], device=self.device)
        yield from self._generated(group, eos, self.text_model, {"input_ids": ids, "attention_mask": mask})

    def _generate_images(self, group: list[tuple[GenRequest, Sampling]], eos: set, special: bool
                         ) -> Iterator[GenResult]:
        """Requests with images, in one call; a row the model cannot take, or that the processor or the model
        refuses, is that row's error and the rest go on."""
        limit = self.images_per_prompt
        for r, _ in group:
            if limit is not None and len(r.images or []) > limit:
                yield GenResult(r.key, error=f"the row has {len(r.images or [])} images; {type(self.model).__name__} "
                                f"takes {limit} per prompt (engine.limit_mm_per_prompt: {{image: {limit}}} refuses "
                                "such rows when planning)")
        group = [(r, s) for r, s in group if limit is None or len(r.images or []) <= limit]
        if not group:
            return
        try:
            results = list(self._generated(group, eos, self.model, self._image_inputs(group, special)))
        except Exception as e:  # noqa: BLE001 - the rows' images, not the engine: each is tried alone
            if len(group) > 1:
                for one in group:
                    yield from self._generate_images([one], eos, special)
            else:
                yield GenResult(group[0][0].key, error=f"transformers could not take the row's images: {e}")
            return
        yield from results

    def _generated(self, group: list[tuple[GenRequest, Sampling]], eos: set, model, inputs: dict
                   ) -> Iterator[GenResult]:
        """One ``generate`` call over a group's inputs (token ids left-padded to one width, an attention mask, any
        pixels), its outputs cut at each row's limits and stops."""
        import torch

        first = group[0][1]
        pad = self.tok.pad_token_id
        width = inputs["input_ids"].shape[1]
        prompt_tokens = inputs["attention_mask"].sum(dim=1).tolist()
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
            out = model.generate(**inputs, **gen)
        for (r, s), row, n_prompt in zip(group, out[:, width:].tolist(), prompt_tokens):
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
            yield GenResult(r.key, text=text, finish_reason=reason, prompt_tokens=int(n_prompt),
                            completion_tokens=counted)

    def close(self) -> None:
        self.model = None


def _text_generator(model):
    """What generates from text alone: the model itself, or for a vision-language model whose ``generate`` needs
    pixels (BLIP-2's) its language model, as vLLM runs such a model's text-only prompts; None where there is none."""
    needs = inspect.signature(model.generate).parameters.get("pixel_values")
    if needs is None or needs.default is not inspect.Parameter.empty:
        return model
    language_model = getattr(model, "language_model", None)
    return language_model if callable(getattr(language_model, "generate", None)) else None
