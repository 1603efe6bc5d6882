"""What the sizing model (``batch_llm.sizing.recommend``, pure) needs from this machine, and the check built on it: the
sizes of the GPUs this worker hands out (nvidia-smi), the model's config.json where the fetch stage left it, and
the fetch stage's warning when the configured tensor-parallel group cannot hold the model on those GPUs.

Kept out of ``recommend`` so that the model stays plain arithmetic over its inputs; ``recommend`` does not import
this module (that would be an import cycle): import these names from here."""
from __future__ import annotations

from pathlib import Path

from batch_llm.host.probes import model_config_json
from batch_llm.sizing.recommend import ModelShape, RecommendError, gpu_fit_warning, job_from_config


def worker_gpu_memory_gib() -> list[float]:
    """Total memory (GiB) of each GPU this worker hands out (``gpu_lease.visible_gpus``, sizes from nvidia-smi);
    [] on a machine without GPUs or when nvidia-smi does not answer."""
    import shutil
    import subprocess

    from batch_llm.host.gpus import visible_gpus

    ids = visible_gpus()
    if not ids or not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    sizes = {}
    for line in out.splitlines():
        idx, _, mib = line.partition(",")
        try:
            sizes[idx.strip()] = float(mib) / 1024
        except ValueError:
            continue
    return [sizes[i] for i in ids if i in sizes]


def fetch_fit_warning(cfg, model_dir: str, gpu_memory_gib: list[float] | None = None) -> str | None:
    """The fetch stage's check: on a worker with GPUs, why the model cannot start at the configured
    ``engine.tensor_parallel_size`` on them (None when it can, on a CPU worker, or for a config this module
    cannot read). ``gpu_memory_gib``: the GPUs' sizes (default: this worker's, from nvidia-smi)."""
    if not cfg.engine.caps.kv_cache_pool:  # the memory plan is of an engine sizing a KV-cache pool
        return None
    gpus = worker_gpu_memory_gib() if gpu_memory_gib is None else gpu_memory_gib
    if not gpus:
        return None
    config = model_config_json(model_dir)
    try:
        shape = ModelShape.from_config(config, name=cfg.model.ref) if config else None
    except RecommendError:
        return None
    if shape is None:
        return None
    job = job_from_config(cfg, model_config=config)
    return gpu_fit_warning(shape, min(gpus), len(gpus), cfg.engine.tensor_parallel_size, job)


def find_model_config(cfg) -> Path:
    """The config.json of a pipeline's model where it is on this machine: ``model.ref`` as a local folder, else
    the folder the fetch stage leaves in the model cache (ModelScope snapshot, or the copy of a storage
    prefix). Raises RecommendError naming the places looked at."""
    import hashlib

    from batch_llm.demo_model import snapshot_dir
    from batch_llm.host.path_policy import classify_ref, local_path

    ref, cache = cfg.model.ref, Path(cfg.model.resolved_cache_dir())
    try:
        kind = classify_ref(ref)
    except ValueError as e:
        raise RecommendError(str(e)) from None
    if kind == "local":
        places = [Path(local_path(ref) or ref)]
    elif kind == "modelscope":
        places = [snapshot_dir(cache, ref, cfg.model.revision), cache / ref, cache / "models" / ref]
    else:
        places = [cache / "storage" / hashlib.sha256(ref.encode()).hexdigest()[:16]]
    for p in places:
        if (p / "config.json").is_file():
            return p / "config.json"
    raise RecommendError(f"model.ref {ref}: no config.json on this machine (looked in "
                         f"{', '.join(str(p) for p in places)}); run the fetch stage once, or give --model-config PATH")
