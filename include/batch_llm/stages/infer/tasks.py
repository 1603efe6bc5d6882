"""The inference tasks: ``sharding.shards_per_task`` consecutive shards a task, run in turn on one engine
(``runner.SharedEngine``). Each shard keeps its own folder, started over where it was made from other inputs
(``identity.drop_stale_shard``)."""
from __future__ import annotations

from collections.abc import Callable

from batch_llm.config import PipelineConfig
from batch_llm.layout import RunLayout
from batch_llm.manifests import FetchManifest, ModelRef, PlanManifest, QuantizeManifest, ShardManifest, ShardSpec
from batch_llm.stages.infer.identity import drop_stale_shard, shard_inputs
from batch_llm.stages.infer.runner import ShardFailed, SharedEngine, run_shard


def shard_tasks(cfg: PipelineConfig, plan: PlanManifest) -> list[list[ShardSpec]]:
    """The plan's shards as the inference tasks run them: ``sharding.shards_per_task`` consecutive shards a
    task (the last task may have fewer), each task one engine (``infer_shards``)."""
    k = cfg.sharding.shards_per_task
    return [plan.shards[i:i + k] for i in range(0, len(plan.shards), k)]


def infer_shards(cfg: PipelineConfig, layout: RunLayout, model: ModelRef | FetchManifest | QuantizeManifest | dict,
                 shards: list[ShardSpec | dict], say: Callable[[str], None] = print, started: dict | None = None,
                 on_committed: Callable[[list[ShardManifest]], None] | None = None,
                 stage: str = "infer") -> list[ShardManifest]:
    """Runs one task's shards in turn on one engine (``runner.SharedEngine``): the first shard that generates
    starts it, the others use it, and it is closed after the last. Each shard keeps its own folder, chunk
    commits and manifest, so a retry skips the shards already committed and resumes the one that was cut
    short. ``on_committed`` is called with every shard's manifest once the last one is durable (the worker
    reports there and ends the engine's processes itself); ``started`` (the worker's clock) goes to the
    first shard's timeline. One shard: ``infer_shard`` as it is.

    A shard with too many error rows (``ShardFailed``: its outputs, errors and manifest are written) does not stop
    the task's other shards: they run and commit, then the task fails naming the failed shards, as separate
    tasks would have (a re-run with a higher ``engine.max_error_rate`` takes every committed shard as it is)."""

    specs = [ShardSpec.model_validate(s) for s in shards]
    if len(specs) == 1:
        last = (lambda m: on_committed([m])) if on_committed is not None else None
        return [infer_shard(cfg, layout, model, specs[0], say=say, started=started, on_committed=last, stage=stage)]
    engine = SharedEngine()
    done: list[ShardManifest] = []
    failed: list[str] = []
    try:
        for i, spec in enumerate(specs):
            last = None
            if on_committed is not None and i == len(specs) - 1 and not failed:  # reported only if all passed
                last = lambda m: on_committed([*done, m])  # noqa: E731
            try:
                done.append(infer_shard(cfg, layout, model, spec, say=say, started=started if i == 0 else None,
                                        on_committed=last, shared_engine=engine, stage=stage))
            except ShardFailed as e:
                failed.append(str(e))
                say(f"{e}; the task's other shards go on")
    finally:
        engine.close()
    say(f"{len(specs)} shards on one engine: started {engine.starts} time(s)")
    if failed:
        raise ShardFailed(f"{len(failed)} of {len(specs)} shards of this task failed (the others committed): "
                          + " | ".join(failed))
    return done


def infer_shard(cfg: PipelineConfig, layout: RunLayout, model: ModelRef | FetchManifest | QuantizeManifest | dict,
                shard: ShardSpec | dict,
                say: Callable[[str], None] = print, started: dict | None = None,
                on_committed: Callable[[ShardManifest], None] | None = None,
                shared_engine: "SharedEngine | None" = None, stage: str = "infer") -> ShardManifest:
    """Runs one shard in this process (the GPU operator runs it in a spawned worker instead, which passes its
    own start times as ``started`` and reports from ``on_committed``, before the engine's shutdown).
    ``shared_engine``: the ``runner.SharedEngine`` of the task's shards (``infer_shards``). ``stage``: the run's
    folder the shard commits in (``review``: the content review's pass, ``stages.review``)."""

    shard = ShardSpec.model_validate(shard)
    ref = ModelRef.of(model)
    shard_dir = layout.shard_dir(shard.index, stage)
    drop_stale_shard(shard_dir, shard_inputs(cfg, ref, shard), say)
    return run_shard(cfg, shard=shard, shard_dir=shard_dir,
                     model_dir=ref.local_dir, model_key=ref.model_key, lora_dir=ref.lora_dir,
                     cache_root=layout.cache_root(cfg), say=say, started=started, on_committed=on_committed,
                     shared_engine=shared_engine, image_options=layout.input.options)
