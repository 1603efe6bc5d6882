"""Running a shard in a process of its own: the GPU operator's machinery, used by the CLI and benchmarks too.

- ``shard_process``: ``run_shard_isolated`` / ``IsolatedShard``: GPU lease, spawn, wait, release, stop
- ``worker_parent``: the parent's side of the worker (spawn in a new process group, read its reports)
- ``worker_child``: the worker itself (``python -m batch_llm.isolation.worker_child``): imports the engine, runs
  the shard(s), reports back
- ``gpu_lease``: which GPUs a shard may use, leased through files so that concurrent tasks never share one
"""

__all__ = ["gpu_lease", "shard_process", "worker_child", "worker_parent"]
