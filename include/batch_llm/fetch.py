"""Fetch the model: a ModelScope id (through a persistent cache), a local directory, or a storage prefix.

The manifest records what was resolved: source, id, revision, local directory, and every file with its
size and SHA-256, so a run says exactly which weights produced its outputs (``model_key``).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from batch_llm.config import ModelConfig
from batch_llm.storage import as_path

log = logging.getLogger("batch_llm.fetch")

_STORAGE_SCHEMES = ("s3://", "gs://", "gcs://", "az://", "abfs://", "abfss://", "hf://", "memory://")


def classify_ref(ref: str) -> str:
    if ref.startswith(_STORAGE_SCHEMES):
        return "storage"
    if ref.startswith(("/", "./", "../", "~", "file://")) or os.path.isdir(os.path.expanduser(ref)):
        return "local"
    if ref.count("/") == 1 and all(ref.split("/")):
        return "modelscope"
    raise ValueError(f"model.ref {ref!r} is neither a ModelScope id (owner/name), a local directory, "
                     f"nor an object-storage prefix ({', '.join(_STORAGE_SCHEMES)})")


def _modelscope_snapshot(cfg: ModelConfig) -> tuple[str, bool]:
    """(directory, cache hit). Cache first with local_files_only: a hit never touches the network."""
    cache_dir = cfg.resolved_cache_dir()
    os.environ.setdefault("MODELSCOPE_CACHE", cache_dir)
    from modelscope import snapshot_download

    try:
        return snapshot_download(cfg.ref, revision=cfg.revision, cache_dir=cache_dir, local_files_only=True), True
    except Exception as e:  # noqa: BLE001 - ModelScope raises several types for a miss
        log.info("model %s@%s not in cache %s (%s); downloading", cfg.ref, cfg.revision, cache_dir, type(e).__name__)
    return snapshot_download(cfg.ref, revision=cfg.revision, cache_dir=cache_dir), False


def _sync_from_storage(cfg: ModelConfig, options: dict) -> tuple[str, bool]:
    """Copies an object-storage prefix into the local cache (files whose size differs, only)."""
    src = as_path(cfg.ref, options)
    dest = Path(cfg.resolved_cache_dir()) / "storage" / hashlib.sha256(cfg.ref.encode()).hexdigest()[:16]
    hit = True
    for obj in src.rglob("*"):
        if obj.is_dir():
            continue
        rel = obj.relative_to(src) if hasattr(obj, "relative_to") else obj.name
        target = dest / str(rel)
        size = obj.stat().st_size
        if target.exists() and target.stat().st_size == size:
            continue
        hit = False
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".part")
        with obj.open("rb") as fin, open(tmp, "wb") as fout:
            while block := fin.read(8 << 20):
                fout.write(block)
        os.replace(tmp, target)
    if not dest.exists():
        raise FileNotFoundError(f"model prefix {cfg.ref} is empty or missing")
    return str(dest), hit


def file_hashes(directory: str) -> list[dict]:
    """Size and SHA-256 of every file; hashes are remembered by (size, mtime) so a re-fetch costs nothing."""
    root = Path(directory)
    memo_path = Path(os.path.expanduser("~/.cache/batch_llm/hashes")) / (
        hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:16] + ".json")
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    files = []
    for p in sorted(root.rglob("*")):
        if not p.is_file() or p.name.startswith("."):
            continue
        st = p.stat()
        rel = str(p.relative_to(root))
        stamp = f"{st.st_size}:{st.st_mtime_ns}"
        if memo.get(rel, {}).get("stamp") != stamp:
            h = hashlib.sha256()
            with open(p, "rb") as f:
                while block := f.read(8 << 20):
                    h.update(block)
            memo[rel] = {"stamp": stamp, "sha256": h.hexdigest()}
        files.append({"name": rel, "size": st.st_size, "sha256": memo[rel]["sha256"]})
    memo_path.parent.mkdir(parents=True, exist_ok=True)
    memo_path.write_text(json.dumps(memo))
    return files


def fetch_model(cfg: ModelConfig, *, storage_options: dict | None = None) -> dict:
    kind = classify_ref(cfg.ref)
    if kind == "modelscope":
        local_dir, hit = _modelscope_snapshot(cfg)
    elif kind == "storage":
        local_dir, hit = _sync_from_storage(cfg, storage_options or {})
    else:
        local_dir, hit = os.path.abspath(os.path.expanduser(cfg.ref.removeprefix("file://"))), True
        if not os.path.isfile(os.path.join(local_dir, "config.json")):
            raise FileNotFoundError(f"model.ref {cfg.ref}: no config.json in {local_dir}")
    files = file_hashes(local_dir)
    content = hashlib.sha256(json.dumps([(f["name"], f["sha256"]) for f in files]).encode()).hexdigest()
    return {"stage": "fetch", "source": kind, "id": cfg.ref, "revision": cfg.revision if kind == "modelscope" else None,
            "local_dir": local_dir, "cache_hit": hit, "files": files,
            "total_bytes": sum(f["size"] for f in files), "content_hash": content,
            "model_key": f"{cfg.ref}@{cfg.revision}#{content[:16]}"}
