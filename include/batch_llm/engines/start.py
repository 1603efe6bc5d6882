"""Engine start for a shard: memory back-off within bounds, the optional KV-cache probe, and the precision gate
(``engine.precision: auto``: ``precision_gate.py``).

A start that fails for memory (the engine's own message says so: see ``EngineStartError.memory``) is retried
with smaller settings, never below ``engine.memory_backoff``'s floors; any other failure is raised at once.
With ``engine.replicas`` > 1 each replica gets its share of the memory; the first starts as one engine would
(back-off, probe, precision gate), the others one after another with the settings it ended with, by default
while the first generates (``engine.replica_start``, ``replicas.py``).
"""
from __future__ import annotations

from collections.abc import Callable

from batch_llm.cache import compile as compile_cache
from batch_llm.config import EngineConfig, PipelineConfig
from batch_llm.engines.base import EngineInfo, EngineStartError
from batch_llm.engines.precision_gate import PrecisionInputs, gated_start
from batch_llm.engines.registry import make_engine
from batch_llm.engines.replicas import start_replicas


def start_engine(model_dir: str, cfg: PipelineConfig, say: Callable[[str], None], *, lora_dir: str | None = None,
                 storage_options: dict | None = None, precision: PrecisionInputs | None = None):
    """Starts the engine, retrying a start that failed for memory with smaller settings within bounds; with
    ``engine.memory_backoff.probe``, restarts it once with the largest batch its KV cache holds, less the
    safety margin. ``engine.compile_cache`` is synced in before (``storage_options``: its store's fsspec
    options) and out after a successful start; what it held is in the settings' ``compile_cache``."""
    cc = _prepare_compile_cache(model_dir, cfg, say, lora_dir, storage_options)
    replicas = cfg.engine.replicas
    cfg = replica_share(cfg)
    if cfg.engine.precision == "auto":  # the candidate precision where a sample of the rows agrees
        inputs = precision or PrecisionInputs(sample=list, store=None, model_key=model_dir)
        engine, info = gated_start(cfg, lambda c: _probed_start(model_dir, c, say, lora_dir), inputs, say)
    else:
        engine, info = _probed_start(model_dir, cfg, say, lora_dir)
    if replicas > 1:
        engine, info = start_replicas(engine, info, replicas, lambda: _start_as(model_dir, info, cfg, say, lora_dir),
                                      say, beside=cfg.engine.replica_start == "beside")
    if cc is not None:
        compile_cache.publish(cc, say)
        info.settings["compile_cache"] = cc.record()
    return engine, info


def _start_as(model_dir: str, first: EngineInfo, cfg: PipelineConfig, say: Callable[[str], None],
              lora_dir: str | None):
    """A further replica, started once with the settings the first ended with (its back-off, probe and precision
    decision): the replicas then pull the same window of requests ahead (the dealing's balance assumes it), and
    one that does not fit is left out rather than started smaller."""
    if first.config is None:
        raise EngineStartError("the first replica's engine did not say the settings it started with")
    once = first.config.memory_backoff.model_copy(update={"enabled": False})
    return _start_with_backoff(model_dir, first.config.model_copy(update={"memory_backoff": once}), cfg, say, lora_dir)


def replica_share(cfg: PipelineConfig) -> PipelineConfig:
    """``cfg`` with each of ``engine.replicas``' share of the memory: gpu_memory_utilization and the back-off's
    absolute shares (its floor and step) divided by the replicas; ``cfg`` itself for one."""
    e = cfg.engine
    n = e.replicas
    if n == 1:
        return cfg
    b = e.memory_backoff
    backoff = b.model_copy(update={"min_gpu_memory_utilization": round(b.min_gpu_memory_utilization / n, 4),
                                   "gpu_memory_utilization_step": round(b.gpu_memory_utilization_step / n, 4)})
    engine = e.model_copy(update={"gpu_memory_utilization": round(e.gpu_memory_utilization / n, 4),
                                  "memory_backoff": backoff})
    return cfg.model_copy(update={"engine": engine})


def _prepare_compile_cache(model_dir: str, cfg: PipelineConfig, say: Callable[[str], None], lora_dir: str | None,
                           storage_options: dict | None) -> compile_cache.CompileCache | None:
    if cfg.engine.compile_cache is None or not cfg.engine.caps.compile_cache:
        return None
    rank = None
    if lora_dir is not None:
        from batch_llm.host.probes import adapter_rank

        rank = adapter_rank(lora_dir)
    return compile_cache.prepare(cfg.engine.compile_cache, model_dir, cfg.engine, say, options=storage_options,
                                 lora_rank=rank)


def _probed_start(model_dir: str, cfg: PipelineConfig, say: Callable[[str], None], lora_dir: str | None):
    engine, info = _start_with_backoff(model_dir, cfg.engine, cfg, say, lora_dir)
    b = cfg.engine.memory_backoff
    if not b.probe:
        return engine, info
    s = info.settings
    probe = kv_cache_probe(s, b)
    if probe is None:
        say("probe: the engine did not report its KV cache size; max_num_seqs kept")
        return engine, info
    chosen = probe["max_num_seqs"]
    say(f"probe: the KV cache holds {probe['kv_cache_tokens']:,} tokens = {probe['sequences_that_fit']:,} "
        f"sequences of {s['max_model_len']:,} tokens; max_num_seqs {chosen} keeps {b.safety_margin:.0%} free "
        f"(was {s.get('max_num_seqs')})")
    if chosen == s.get("max_num_seqs"):
        info.settings["probe"] = probe
        return engine, info
    engine.close()
    ecfg = info.config.model_copy(update={"max_num_seqs": chosen})
    engine, again = _start_with_backoff(model_dir, ecfg, cfg, say, lora_dir)
    again.start_seconds += info.start_seconds  # the probe's start is part of this shard's start cost
    again.attempts = info.attempts + again.attempts
    again.settings["probe"] = probe
    return engine, again


def kv_cache_probe(settings: dict, b) -> dict | None:
    """The most sequences of max_model_len tokens the KV cache holds, and max_num_seqs: that less the safety
    margin, within bounds. None when the engine did not report its KV cache."""
    blocks, block, max_len = settings.get("num_kv_blocks"), settings.get("block_size"), settings.get("max_model_len")
    if not (blocks and block and max_len):
        return None
    fits = blocks * block // max_len
    return {"kv_cache_tokens": blocks * block, "max_model_len": max_len, "sequences_that_fit": fits,
            "safety_margin": b.safety_margin,
            "max_num_seqs": max(1, min(b.probe_max_num_seqs, int(fits * (1 - b.safety_margin))))}


def _start_with_backoff(model_dir: str, ecfg: EngineConfig, cfg: PipelineConfig, say: Callable[[str], None],
                        lora_dir: str | None = None):
    b = ecfg.memory_backoff
    attempts: list[dict] = []
    for attempt in range(1, b.max_attempts + 1):
        engine = make_engine(model_dir, ecfg, cfg.sampling, trust_remote_code=cfg.model.trust_remote_code,
                             lora_dir=lora_dir)
        tried = dict(gpu_memory_utilization=ecfg.gpu_memory_utilization, max_num_seqs=ecfg.max_num_seqs,
                     max_model_len=ecfg.max_model_len)
        try:
            info = engine.start()
        except EngineStartError as e:
            engine.close()
            attempts.append({**tried, "error": str(e)[-500:], "memory": e.memory})
            if not (e.memory and b.enabled and attempt < b.max_attempts):
                raise
            smaller = smaller_settings(ecfg, e)
            if smaller is None:
                raise EngineStartError(f"{e}\nno smaller setting is left within engine.memory_backoff bounds",
                                       memory=True) from e
            say(f"engine start failed for memory (attempt {attempt}); retrying with {smaller}")
            ecfg = ecfg.model_copy(update=smaller)
            continue
        attempts.append({**tried, "ok": True})
        info.attempts = attempts
        info.config = ecfg
        if attempt > 1:
            say(f"engine started after back-off with {tried}")
        return engine, info
    raise AssertionError("unreachable")


def smaller_settings(e: EngineConfig, err: EngineStartError) -> dict | None:
    b = e.memory_backoff
    upd: dict = {}
    if err.suggested_max_model_len and e.max_model_len and err.suggested_max_model_len < e.max_model_len:
        upd["max_model_len"] = max(b.min_max_model_len, err.suggested_max_model_len // 16 * 16)
    else:
        util = round(e.gpu_memory_utilization - b.gpu_memory_utilization_step, 3)
        if util >= b.min_gpu_memory_utilization:
            upd["gpu_memory_utilization"] = util
        seqs = (e.max_num_seqs or 256) // 2
        if seqs >= b.min_max_num_seqs:
            upd["max_num_seqs"] = seqs
        if e.max_model_len and e.max_model_len // 2 >= b.min_max_model_len and not upd:
            upd["max_model_len"] = e.max_model_len // 2
    upd = {k: v for k, v in upd.items() if getattr(e, k) != v}
    return upd or None
