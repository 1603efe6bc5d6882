"""How the ``engine`` section becomes LMDeploy's backend config, without importing LMDeploy.

Every key of ``EngineConfig`` is either mapped onto a field of LMDeploy's ``PytorchEngineConfig`` /
``TurbomindEngineConfig`` (LMDeploy 0.18) or refused when the configuration is loaded, with a message naming the
key: a setting is never dropped silently. ``engine.extra`` carries ``backend`` (``pytorch``, the default, or
``turbomind``) and any other field of that backend's config, passed as is.

=========================  =====================================  =========================================
engine key                 PyTorch engine                         TurboMind
=========================  =====================================  =========================================
max_model_len              session_len                            session_len
max_num_seqs               max_batch_size (default 256)           max_batch_size (default 256)
gpu_memory_utilization     cache_max_entry_count (< 1)            cache_max_entry_count
tensor_parallel_size       tp                                     tp
dtype                      dtype: auto / float16 / bfloat16       dtype: auto / float16 / bfloat16
quantization               fp8 -> model_format (awq, gptq and     awq, gptq, compressed-tensors, fp8,
                           compressed-tensors are read from the   mxfp4 -> model_format
                           checkpoint: refused)
kv_cache_dtype             quant_policy: int4 4, int8 8,          quant_policy: int4 4, int8 8
                           fp8 / fp8_e4m3 16, fp8_e5m2 17
enforce_eager              eager_mode                             refused when true (no such switch)
enable_prefix_caching      enable_prefix_caching                  enable_prefix_caching
cpu_kv_cache_gib           refused unless the default (vLLM's CPU backend only)
batch_size                 refused unless the default (the transformers engine only)
speculative                refused when set (vLLM's n-gram speculative decoding only)
compile_cache              refused when set (vLLM's compilation cache only: config.py refuses it)
=========================  =====================================  =========================================

The other keys (``commit_every_*``, ``progress_every_seconds``, ``max_error_rate``, ``dedupe_prompts``,
``memory_backoff``, ``python``) belong to the shard runner and apply to every engine.
"""
from __future__ import annotations

from typing import Any

#: Field names of LMDeploy 0.18.0's ``PytorchEngineConfig`` (lmdeploy/messages.py).
PYTORCH_FIELDS = frozenset({
    "adapters", "attn_tp_size", "block_size", "cache_max_entry_count", "cudagraph_capture_batch_sizes",
    "custom_module_map", "device_type", "distributed_executor_backend", "dllm_block_length",
    "dllm_confidence_threshold", "dllm_denoising_steps", "dllm_unmasking_strategy", "download_dir", "dp", "dp_rank",
    "dtype", "eager_mode", "empty_init", "enable_eplb", "enable_metrics", "enable_microbatch", "enable_mp_engine",
    "enable_prefix_caching", "enable_return_routed_experts", "enable_transfer_obj_ref", "ep", "hf_overrides",
    "kernel_block_size", "kv_transfer_config", "language_model_only", "logprobs_mode", "max_batch_size",
    "max_prefill_token_num", "migration_backend", "mlp_tp_size", "model_format", "moe_tp_size", "mp_engine_backend",
    "num_cpu_blocks", "num_gpu_blocks", "piecewise_cudagraph_max_tokens", "prefill_interval",
    "prefix_cache_decode_state_interval", "prefix_cache_state_budget", "quant_policy", "revision", "role",
    "session_len", "thread_safe", "tp"})
#: Field names of LMDeploy 0.18.0's ``TurbomindEngineConfig``.
TURBOMIND_FIELDS = frozenset({
    "async_", "attn_cp_size", "attn_dp_size", "attn_tp_size", "cache_block_seq_len", "cache_checkpoint_interval",
    "cache_chunk_size", "cache_generation", "cache_max_entry_count", "cache_prompt", "cache_prompt_boundary_skip",
    "communicator", "cp", "device_num", "devices", "dist_init_addr", "download_dir", "dp", "dtype", "empty_init",
    "enable_metrics", "enable_prefix_caching", "ep", "gemm_input_dtype", "hf_overrides", "language_model_only",
    "max_batch_size", "max_prefill_iters", "max_prefill_token_num", "mlp_dp_size", "mlp_tp_size", "model_format",
    "moe_a2a_backend", "nnodes", "node_rank", "num_tokens_per_iter", "outer_dp_size", "quant_policy", "revision",
    "rope_scaling_factor", "session_len", "tp", "use_logn_attn"})
FIELDS = {"pytorch": PYTORCH_FIELDS, "turbomind": TURBOMIND_FIELDS}

#: The LMDeploy field each engine key sets, and the engine key to use instead of setting it in extra.
MAPPED = {"session_len": "max_model_len", "max_batch_size": "max_num_seqs",
          "cache_max_entry_count": "gpu_memory_utilization", "tp": "tensor_parallel_size", "dtype": "dtype",
          "model_format": "quantization", "quant_policy": "kv_cache_dtype", "eager_mode": "enforce_eager",
          "enable_prefix_caching": "enable_prefix_caching"}
DTYPES = {"auto": "auto", "float16": "float16", "half": "float16", "bfloat16": "bfloat16"}
MODEL_FORMATS = {"pytorch": ("fp8",), "turbomind": ("awq", "gptq", "compressed-tensors", "fp8", "mxfp4")}
QUANT_POLICY = {"pytorch": {"auto": 0, "int4": 4, "int8": 8, "fp8": 16, "fp8_e4m3": 16, "fp8_e5m2": 17},
                "turbomind": {"auto": 0, "int4": 4, "int8": 8}}
DEFAULT_MAX_BATCH_SIZE = 256

# LMDeploy's RequestError codes (lmdeploy/serve/core/exceptions.py) that blame the request, not the engine.
REQUEST_ERROR_CODES = frozenset({"invalid_request", "context_length_exceeded", "unsupported_feature",
                                 "preprocess_failed"})


def _default(cfg: Any, key: str) -> Any:
    return type(cfg).model_fields[key].default


def lmdeploy_problems(cfg: Any) -> list[str]:  # noqa: C901
    """Why an ``EngineConfig`` cannot run as configured on LMDeploy: one message per key, naming it. Empty
    when every key is honored."""
    out: list[str] = []
    backend = cfg.extra.get("backend", "pytorch")
    if backend not in FIELDS:
        return [f"engine.extra.backend: {backend!r} is not an LMDeploy backend (pytorch or turbomind)"]
    fields = FIELDS[backend]
    for key in cfg.extra:
        if key == "backend":
            continue
        if key in MAPPED:
            out.append(f"engine.extra.{key}: set engine.{MAPPED[key]} instead (LMDeploy's {key} comes from it)")
        elif key == "trust_remote_code":
            out.append("engine.extra.trust_remote_code: set model.trust_remote_code instead")
        elif key not in fields:
            out.append(f"engine.extra.{key}: LMDeploy's {backend} engine config (0.18) has no field {key!r}")
    if cfg.dtype not in DTYPES:
        out.append(f"engine.dtype: {cfg.dtype!r} is not an LMDeploy dtype (auto, float16, bfloat16)")
    if cfg.quantization is not None and cfg.quantization not in MODEL_FORMATS[backend]:
        hint = ("; the PyTorch engine reads awq, gptq and compressed-tensors from the checkpoint's "
                "quantization_config: leave engine.quantization unset") if backend == "pytorch" else ""
        out.append(f"engine.quantization: {cfg.quantization!r} is not a model_format LMDeploy's {backend} engine "
                   f"takes ({', '.join(MODEL_FORMATS[backend])}){hint}")
    if cfg.kv_cache_dtype not in QUANT_POLICY[backend]:
        out.append(f"engine.kv_cache_dtype: {cfg.kv_cache_dtype!r} has no LMDeploy {backend} quant_policy "
                   f"({', '.join(QUANT_POLICY[backend])})")
    if backend == "pytorch" and cfg.gpu_memory_utilization >= 1:
        out.append("engine.gpu_memory_utilization: LMDeploy's PyTorch engine takes a share of free memory "
                   "below 1 (its cache_max_entry_count)")
    if backend == "turbomind" and cfg.enforce_eager:
        out.append("engine.enforce_eager: LMDeploy's TurboMind engine has no eager switch; leave it false")
    if cfg.cpu_kv_cache_gib != _default(cfg, "cpu_kv_cache_gib"):
        out.append("engine.cpu_kv_cache_gib: only vLLM's CPU backend reads it; LMDeploy runs on GPUs")
    if cfg.batch_size != _default(cfg, "batch_size"):
        out.append("engine.batch_size: only the transformers engine reads it; LMDeploy batches continuously "
                   "(engine.max_num_seqs is its max_batch_size)")
    return out


def lmdeploy_backend_config(cfg: Any) -> tuple[str, dict]:
    """(backend, keyword arguments of its LMDeploy engine config) for an ``EngineConfig``; ValueError naming
    the keys LMDeploy cannot honor."""
    problems = lmdeploy_problems(cfg)
    if problems:
        raise ValueError("; ".join(problems))
    backend = cfg.extra.get("backend", "pytorch")
    kwargs: dict[str, Any] = dict(session_len=cfg.max_model_len,
                                  max_batch_size=cfg.max_num_seqs or DEFAULT_MAX_BATCH_SIZE,
                                  cache_max_entry_count=cfg.gpu_memory_utilization, tp=cfg.tensor_parallel_size,
                                  dtype=DTYPES[cfg.dtype], quant_policy=QUANT_POLICY[backend][cfg.kv_cache_dtype])
    if cfg.quantization is not None:
        kwargs["model_format"] = cfg.quantization
    if cfg.enable_prefix_caching is not None:
        kwargs["enable_prefix_caching"] = cfg.enable_prefix_caching
    if backend == "pytorch":
        kwargs["eager_mode"] = cfg.enforce_eager
    kwargs.update({k: v for k, v in cfg.extra.items() if k != "backend"})
    return backend, kwargs


def lmdeploy_request_refusal(e: BaseException) -> bool:
    """Whether an exception from one LMDeploy request is that request's fault (an error row) rather than the
    engine's (the shard fails and is retried). LMDeploy 0.18 raises ``RequestError`` with a code: the codes
    for invalid input, an over-long context, an unsupported feature or a failed preprocessing blame the
    request; ``engine_unavailable`` (the engine stopped), ``internal_error`` (a CUDA error, a crashed engine
    loop) and anything else are the engine's. Without a code, ``ValueError``/``TypeError`` are input checks."""
    code = getattr(e, "code", None)
    code = getattr(code, "value", code)
    if isinstance(code, str):
        return code in REQUEST_ERROR_CODES
    return isinstance(e, (ValueError, TypeError))
