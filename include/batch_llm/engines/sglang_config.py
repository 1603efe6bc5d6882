"""How the ``engine`` section becomes SGLang's offline engine (``sglang.Engine``), without importing SGLang.

Written against SGLang 0.5.17 (``python/sglang/srt/server_args.py``, ``sampling/sampling_params.py``,
``managers/tokenizer_manager.py``); the CPU check ran 0.5.19, whose fields used here are the same. Every key of
``EngineConfig`` is mapped onto a ``ServerArgs`` field or refused when the configuration is loaded, naming the key;
``engine.sglang`` holds SGLang's own settings (``SglangSettings``, config/sglang.py), and ``engine.extra`` any
other ``ServerArgs`` field, passed as is (an unknown one fails the engine start, naming it).

=========================  ==========================================================================
engine key                 SGLang
=========================  ==========================================================================
max_model_len              context_length
max_num_seqs               max_running_requests (null: SGLang sizes it from its KV pool)
gpu_memory_utilization     mem_fraction_static (weights + KV pool, a share of the GPU's memory)
tensor_parallel_size       tp_size
dtype                      dtype: auto / float16 / bfloat16 / float32 (auto: float32 on a CPU without bf16)
quantization               quantization
kv_cache_dtype             kv_cache_dtype
enforce_eager              disable_cuda_graph
enable_prefix_caching      disable_radix_cache = not it (null: SGLang's radix cache, on)
sglang.cuda_graph_max_bs   cuda_graph_max_bs_decode (SGLang's --cuda-graph-max-bs)
sglang.max_total_tokens    max_total_tokens
sglang.chunked_prefill_size  chunked_prefill_size
sglang.deterministic_inference  enable_deterministic_inference (per-request seeds)
cpu_kv_cache_gib           refused unless the default (vLLM's CPU backend only)
batch_size                 refused unless the default (the transformers engine only)
cuda_graphs                refused unless the default (vLLM's graph sets; SGLang: sglang.cuda_graph_max_bs)
=========================  ==========================================================================

``speculative``, ``multiprocessing``, ``torch_compile``, ``compile_cache`` and ``task`` other than generate are
refused by config.py from the capability row; the bookkeeping keys (``commit_every_*``, ``memory_backoff`` ...)
belong to the shard runner. SGLang's own speculative algorithms (``speculative_algorithm: NGRAM`` and its
``speculative_ngram_*`` fields) have none of ``engine.speculative``'s prompt-lookup settings: they go through
``engine.extra``, unmeasured.

Defaults: every ``engine.sglang`` key is null, which is SGLang's own choice (on an H200 below TP 4: decode graphs up
to 256 sequences, chunked prefill 8192 tokens, the KV pool from the memory share). They stay SGLang's until an H200
measurement says otherwise (none yet); ``engine.gpu_memory_utilization`` keeps the section's default (0.9), where
SGLang's own estimate on a 141 GB H200 with those settings is about 0.89.
"""
from __future__ import annotations

import json
from typing import Any

from batch_llm.rows.params import row_response_format

#: The ServerArgs fields the engine section sets (engine.extra names them only through their engine key).
MAPPED = {"context_length": "max_model_len", "max_running_requests": "max_num_seqs",
          "mem_fraction_static": "gpu_memory_utilization", "tp_size": "tensor_parallel_size",
          "tensor_parallel_size": "tensor_parallel_size", "dtype": "dtype", "quantization": "quantization",
          "kv_cache_dtype": "kv_cache_dtype", "disable_cuda_graph": "enforce_eager",
          "disable_radix_cache": "enable_prefix_caching", "cuda_graph_max_bs": "sglang.cuda_graph_max_bs",
          "cuda_graph_max_bs_decode": "sglang.cuda_graph_max_bs", "max_total_tokens": "sglang.max_total_tokens",
          "chunked_prefill_size": "sglang.chunked_prefill_size",
          "enable_deterministic_inference": "sglang.deterministic_inference",
          "model_path": "model.ref", "tokenizer_path": "model.ref", "trust_remote_code": "model.trust_remote_code",
          "random_seed": "sampling.seed", "enable_lora": "model.lora", "lora_paths": "model.lora",
          "max_lora_rank": "model.lora", "is_embedding": "engine.task"}
#: ServerArgs fields the engine owns: set by engine.extra they would break it.
OWNED = {"custom_sigquit_handler": "the engine's start-failure handling installs its own",
         "skip_tokenizer_init": "the engine needs SGLang's detokenized text",
         "device": "the engine picks cuda when a GPU is visible, cpu otherwise"}
#: SGLang's ``--dtype`` choices (server_args.py).
DTYPES = frozenset({"auto", "half", "float16", "bfloat16", "float", "float32"})


def _default(cfg: Any, key: str) -> Any:
    return type(cfg).model_fields[key].default


def sglang_problems(cfg: Any) -> list[str]:
    """Why an ``EngineConfig`` cannot run as configured on SGLang: one message per key, naming it. Empty when
    every key is honoured."""
    out: list[str] = []
    for key in cfg.extra:
        if key in MAPPED:
            out.append(f"engine.extra.{key}: set {_where(MAPPED[key])} instead (SGLang's {key} comes from it)")
        elif key in OWNED:
            out.append(f"engine.extra.{key}: {OWNED[key]}")
    if cfg.dtype not in DTYPES:
        out.append(f"engine.dtype: {cfg.dtype!r} is not an SGLang dtype ({', '.join(sorted(DTYPES))})")
    if cfg.cpu_kv_cache_gib != _default(cfg, "cpu_kv_cache_gib"):
        out.append("engine.cpu_kv_cache_gib: only vLLM's CPU backend reads it; SGLang's KV pool is "
                   "engine.gpu_memory_utilization's share (or engine.sglang.max_total_tokens)")
    if cfg.batch_size != _default(cfg, "batch_size"):
        out.append("engine.batch_size: only the transformers engine reads it; SGLang batches continuously "
                   "(engine.max_num_seqs is its max_running_requests)")
    if cfg.cuda_graphs != _default(cfg, "cuda_graphs"):
        out.append("engine.cuda_graphs: vLLM's graph sets; SGLang's are engine.sglang.cuda_graph_max_bs "
                   "(engine.enforce_eager: true turns them off)")
    return out


def _where(key: str) -> str:
    return key if "." in key and not key.startswith("sglang.") else f"engine.{key}"


def sglang_engine_args(cfg: Any, model_dir: str, *, seed: int | None, trust_remote_code: bool, dtype: str,
                       deterministic: bool, fields: frozenset[str] | None = None, on_gpu: bool = True,
                       lora: tuple[str, int] | None = None) -> dict:
    """The keyword arguments of ``sglang.Engine`` for an ``EngineConfig``. ``dtype``: engine.dtype as this machine
    gets it (``probes.cpu_dtype``); ``fields``: the installed ServerArgs' field names (the CUDA graph ceiling's
    name changed: ``cuda_graph_max_bs_decode`` in 0.5.17, ``cuda_graph_max_bs`` before); ``lora``: a served
    adapter's (folder, max rank). ValueError naming the keys SGLang cannot honour."""
    problems = sglang_problems(cfg)
    if problems:
        raise ValueError("; ".join(problems))
    s = cfg.sglang
    args: dict[str, Any] = dict(model_path=model_dir, tokenizer_path=model_dir, context_length=cfg.max_model_len,
                                max_running_requests=cfg.max_num_seqs, mem_fraction_static=cfg.gpu_memory_utilization,
                                tp_size=cfg.tensor_parallel_size, dtype=dtype, quantization=cfg.quantization,
                                kv_cache_dtype=cfg.kv_cache_dtype, disable_cuda_graph=cfg.enforce_eager,
                                disable_radix_cache=cfg.enable_prefix_caching is False, random_seed=seed,
                                trust_remote_code=trust_remote_code, max_total_tokens=s.max_total_tokens,
                                chunked_prefill_size=s.chunked_prefill_size,
                                enable_deterministic_inference=deterministic)
    if s.cuda_graph_max_bs is not None:
        graph_key = "cuda_graph_max_bs_decode" if fields is None or "cuda_graph_max_bs_decode" in fields \
            else "cuda_graph_max_bs"
        args[graph_key] = s.cuda_graph_max_bs
    if lora is not None:
        # one adapter, served on every request under this name (max_loras_per_batch counts base-only requests too)
        args.update(enable_lora=True, lora_paths={LORA_NAME: lora[0]}, max_lora_rank=lora[1], max_loras_per_batch=1)
    if not on_gpu:
        # SGLang's CPU engine proper (SGLANG_USE_CPU_ENGINE=1) needs sgl-kernel's CPU build; its portable kernels
        # run elsewhere (docs/engines-and-gpus.md)
        args.update(device="cpu", attention_backend="torch_native", sampling_backend="pytorch")
    args = {k: v for k, v in args.items() if v is not None}
    args.update(cfg.extra)  # engine.extra wins, key by key (mapped and owned keys were refused above)
    return args


#: The name a served adapter (model.lora.merge: false) has in SGLang: each request names it.
LORA_NAME = "model.lora"


def deterministic_inference(cfg: Any, sampling: Any) -> bool:
    """engine.sglang.deterministic_inference, or its default: on when the pipeline samples with a seed."""
    if cfg.sglang.deterministic_inference is not None:
        return cfg.sglang.deterministic_inference
    return sampling.temperature > 0 and sampling.seed is not None


def seeded_sampling_refusal(s: Any, *, deterministic: bool) -> str | None:
    """Why one request's resolved sampling cannot be honoured here, or None: a sampled request with a seed on an
    engine started without deterministic inference (SGLang would ignore the seed)."""
    if deterministic or s.temperature <= 0 or s.seed is None:
        return None
    return (f"seed {s.seed} with temperature {s.temperature}: SGLang draws a seeded sample only with "
            "engine.sglang.deterministic_inference: true (off for this run: the pipeline does not sample with a seed);"
            " set it, or sampling.seed: null for unseeded samples")


def sampling_params(s: Any, *, json_schema: str | None = None, seed: int | None = None) -> dict:
    """SGLang's per-request ``sampling_params`` for one resolved ``Sampling`` (one sample: n > 1 is n requests,
    ``seed`` each sample's; None leaves SGLang's sampler unseeded). Every field of ``Sampling`` but n, logprobs and
    response_format (request arguments and ``json_schema``) reaches SGLang (a unit test checks that none is left
    out). top_k 0 (off) is SGLang's -1; include_stop_str_in_output is its no_stop_trim."""
    params: dict[str, Any] = dict(max_new_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p,
                                  top_k=s.top_k if s.top_k > 0 else -1, min_p=s.min_p,
                                  presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
                                  repetition_penalty=s.repetition_penalty, stop=list(s.stop) or None,
                                  stop_token_ids=list(s.stop_token_ids) or None, ignore_eos=s.ignore_eos,
                                  no_stop_trim=s.include_stop_str_in_output)
    if seed is not None:
        params["sampling_seed"] = seed
    if json_schema is not None:
        params["json_schema"] = json_schema
    return params


def row_json_schema(response_format: str | None, length_bounds: str = "grammar") -> str | None:
    """The grammar a row's own response_format decodes under, as SGLang's ``json_schema`` text (OpenAI's
    json_object: any object, as SGLang's own server maps it), or None."""
    rf = row_response_format(response_format)
    if rf is None:
        return None
    if rf.json_object:
        return '{"type": "object"}'
    return schema_text(rf.schema, length_bounds)


def schema_text(schema: dict, length_bounds: str = "grammar") -> str:
    """A JSON schema as SGLang's ``json_schema`` text; ``length_bounds`` as sampling.guided_length_bounds."""
    if length_bounds == "check":  # the bounds are checked after (OutputSchema)
        from batch_llm.output_schema import without_string_length_bounds

        schema = without_string_length_bounds(schema)
    return json.dumps(schema)


def sglang_request_refusal(e: BaseException) -> bool:
    """Whether an exception from one SGLang request is that request's fault (an error row) rather than the engine's
    (the shard fails and is retried). SGLang's tokenizer manager checks a request with ``ValueError`` (a prompt over
    the context, bad sampling parameters, an invalid grammar: the scheduler's 400 abort is raised as ValueError
    too); ``RequestAbortedError`` (a ValueError: the request was aborted, by a stop), fastapi's ``HTTPException``
    with a 5xx status (the scheduler aborted it: engine trouble) and anything else are the engine's."""
    if type(e).__name__ == "RequestAbortedError":
        return False
    status = getattr(e, "status_code", None)
    if status is not None and type(e).__name__ == "HTTPException":
        return 400 <= int(status) < 500
    return isinstance(e, (ValueError, TypeError))
