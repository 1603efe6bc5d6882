"""The pipeline's stages, one module each, in the order a run goes through them.

Each module holds the stage's run-level function (config + the run's layout in, a manifest out) and the logic
behind it; ``batch_llm.api`` is the facade that names them all.

- ``fetch``: the model from ModelScope, a local folder or object storage, hashed into a manifest
- ``lora``: a LoRA adapter merged into its base model, or checked for the engine to serve
- ``quantize``: the optional AWQ W4A16 / FP8 export (llm-compressor, in an environment of its own), cached
- ``plan``: input rows read and checked (bad rows reported with a reason), split into shards
- ``infer``: one shard (or one task's shards) through an engine: requests, result cache, chunked commits, resume
- ``shard_merge``: a shard's committed chunks merged into its outputs and errors, streamed
- ``content_filter``: the word lists over the merged outputs (flag, mask, drop)
- ``evaluate``: EvalScope's scores and the ``min_score`` gate
- ``publish``: a new version of the partition, the ``_CURRENT.json`` switch, retention
"""

__all__ = ["content_filter", "evaluate", "fetch", "infer", "lora", "plan", "publish", "quantize", "shard_merge"]
