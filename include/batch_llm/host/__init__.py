"""What this machine has and how a path on it is read: the bottom floor, leaves that import nothing of the project.

- ``gpus``: the GPUs this worker may hand out (``$BATCH_LLM_GPUS``, nvidia-smi)
- ``procgroup``: process-group control (signal a whole worker tree, wait for it)
- ``path_policy``: what a user-named path is (local, object storage, shipped list) and whether a run may read it
- ``probes``: the model folder's config.json, a LoRA adapter's rank, this CPU's features, and the dtype an engine
  gets from them
"""

__all__ = ["gpus", "path_policy", "probes", "procgroup"]
