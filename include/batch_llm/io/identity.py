"""What a stage's committed work was made from: fingerprints of files in storage and the keys that decide reuse.

A run's folder is the same for every retry and every *Clear* of one DAG run, so a stage that finds its own
committed work there must tell whether it still holds. It holds when it was made from the same things: the
plan from the same input files (names, sizes, and what the store says changes with the content: an S3 ETag, a
local file's mtime, ctime and inode) and the same settings; a shard's chunks from the same plan and the same
everything that changes an output (``infer.identity.output_identity``; the result cache's namespace hashes it too).
These keys are that comparison, kept small (hashes) so they fit in a manifest.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Iterable
from typing import Any

from upath import UPath

# What fsspec's ``info()`` reports that changes when an object's content changes, per store: S3 and GCS an
# ETag / md5 / generation, a local file its mtime, ctime ("created") and inode (a file replaced by a rename gets
# a new inode even when size and mtime were copied over with it).
_CHANGE_FIELDS = ("ETag", "etag", "md5Hash", "md5", "generation", "VersionId", "mtime", "created", "ino",
                  "LastModified", "last_modified", "updated")


def stable_hash(obj: Any) -> str:
    """SHA-256 of the object's canonical JSON (sorted keys): the same value gives the same key in any process."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str, ensure_ascii=False).encode()).hexdigest()


def change_marks(info: dict[str, Any]) -> dict[str, str]:
    """What of an fsspec ``info()`` changes with the content (``_CHANGE_FIELDS``), as strings."""
    return {k: str(info[k]) for k in _CHANGE_FIELDS if info.get(k) is not None}


def file_fingerprint(path: UPath) -> dict[str, str]:
    """The file's size and its store's change markers, as strings (``info()`` of the file's filesystem)."""
    info = path.fs.info(path.path)
    return {"name": path.name, "size": str(info.get("size")), **change_marks(info)}


def files_key(files: Iterable[UPath]) -> str:
    """One key for a set of files: changes when a file is added, removed, renamed or rewritten."""
    return stable_hash([file_fingerprint(f) for f in files])


# ------------------------------------------------------------------------------------------ what makes an output
# Bumped when what infer.identity.output_identity holds changes meaning, so that no key made before it matches one made after.
OUTPUT_IDENTITY_FORMAT = 2

# The engine section's fields that do not change what the model computes for a row; every other field is part of
# infer.identity.output_identity (tests/unit/test_output_identity.py walks EngineConfig's fields: a new one is in the identity
# unless it is named here, with the reason).
ENGINE_FIELDS_NOT_IN_OUTPUT = frozenset({
    # Scheduling: how many rows run at once, in how much KV cache, over how many GPUs. The same model computes
    # the same rows; which rows share a batch is decided at run time (continuous batching) and moves
    # floating-point results no more than two runs of one config do, which no key can pin down.
    "max_num_seqs", "gpu_memory_utilization", "tensor_parallel_size", "cpu_kv_cache_gib", "batch_size",
    "replicas",  # engines side by side, each serving some of the rows as one engine would (checked row for row)
    "replica_start",  # when the later replicas start: before generation or beside it, the rows the same
    # How the same computation is launched: CUDA graphs, compilation, processes, a shared prefix's KV reused.
    "enforce_eager", "cuda_graphs", "torch_compile", "compile_cache", "multiprocessing", "enable_prefix_caching",
    # SGLang's own: its CUDA graphs' batch ceiling, KV pool, prefill chunks, and batch-invariant kernels (which
    # only make a seeded sample reproducible; without them such a row is an error, never a cached output)
    "sglang",
    # How a start that failed for memory is retried; the context it starts with is checked per row (infer).
    "memory_backoff",
    # The shard runner's bookkeeping: commits, progress lines, when a shard fails, and identical prompts of a
    # greedy or seeded shard generated once (each row gets what its own request would have).
    "commit_every_rows", "commit_every_seconds", "progress_every_seconds", "max_error_rate", "dedupe_prompts",
})


def engine_dtype(dtype: str, model_dir: str) -> str:
    """``engine.dtype`` as the engine here will get it (``probes.cpu_dtype``): ``auto`` is float32 on a CPU
    without native bfloat16 (for an unquantized model), the checkpoint's dtype elsewhere."""
    from batch_llm.host.probes import cpu_dtype

    return cpu_dtype(dtype, model_dir, on_gpu=engine_on_gpu())


@functools.lru_cache(maxsize=1)
def engine_on_gpu() -> bool:
    """Whether an engine started here runs on a GPU, told without initializing CUDA in this process (an engine
    forked from it needs CUDA untouched): CUDA_VISIBLE_DEVICES where set (a GPU lease sets it), else whether
    this worker has GPUs to hand out (``gpus.visible_gpus``)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return visible.strip() not in ("", "-1")
    from batch_llm.host.gpus import visible_gpus

    return bool(visible_gpus())


def identity_parts(identity: dict[str, Any]) -> dict[str, str]:
    """An identity as one short hash per part (``engine.dtype``, ``sampling.temperature``, ``model``, ...): small
    enough for a marker file, and two of them name what changed (``what_changed``)."""
    parts: dict[str, str] = {}
    for name, value in identity.items():
        if name in ("engine", "sampling") and isinstance(value, dict):
            parts.update({f"{name}.{k}": stable_hash(v)[:16] for k, v in value.items()})
        else:
            parts[name] = stable_hash(value)[:16]
    return parts


_PART_NAMES = {"plan": "the plan", "model": "the model", "chat_template": "the chat template",
               "trust_remote_code": "model.trust_remote_code", "format": "the key's format"}


def what_changed(before: dict[str, str], now: dict[str, str]) -> str:
    """What differs between two ``identity_parts``, in words: "engine settings changed: dtype, max_model_len;
    the chat template changed"."""
    changed = sorted(k for k in before.keys() | now.keys() if before.get(k) != now.get(k))
    said = []
    for section, words in (("engine", "engine settings"), ("sampling", "sampling settings")):
        fields = [k.split(".", 1)[1] for k in changed if k.startswith(f"{section}.")]
        if fields:
            said.append(f"{words} changed: {', '.join(fields)}")
    said += [f"{_PART_NAMES.get(k, k)} changed" for k in changed if "." not in k]
    return "; ".join(said) or "nothing changed"
