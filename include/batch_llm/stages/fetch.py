"""Fetch the model: a ModelScope id (through a persistent cache), a local directory, or a storage prefix.

The manifest records what was resolved: source, id, revision, local directory, and every file with its
size and SHA-256, so a run says exactly which weights produced its outputs (``model_key``).

Before anything is hashed, the folder is checked: config.json, the weights (every shard an index lists,
none truncated), a tokenizer, and a chat template (or ``model.chat_template``). A folder that fails stops the
run here, naming the folder and what is missing, before any shard starts an engine.
"""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import struct
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from batch_llm.config import ConfigError, ModelConfig, PipelineConfig
from batch_llm.host import path_policy
from batch_llm.host.path_policy import classify_ref
from batch_llm.io.storage import as_path
from batch_llm.manifests import (
    AdapterRecord,
    FetchManifest,
)
from batch_llm.sizing.inputs import fetch_fit_warning

if TYPE_CHECKING:

    pass
from batch_llm.layout import RunLayout

log = logging.getLogger("batch_llm.stages.fetch")

def _modelscope_snapshot(ref: str, revision: str, cache_dir: str) -> tuple[str, bool]:
    """(directory, cache hit). Cache first with local_files_only: a hit never touches the network."""
    os.environ.setdefault("MODELSCOPE_CACHE", cache_dir)
    from modelscope import snapshot_download

    try:
        return snapshot_download(ref, revision=revision, cache_dir=cache_dir, local_files_only=True), True
    except Exception as e:  # noqa: BLE001 - ModelScope raises several types for a miss
        log.info("model %s@%s not in cache %s (%s); downloading", ref, revision, cache_dir, type(e).__name__)
    return snapshot_download(ref, revision=revision, cache_dir=cache_dir), False


def _sync_from_storage(ref: str, cache_dir: str, options: dict) -> tuple[str, bool]:
    """Copies an object-storage prefix into the local cache: one snapshot folder per state of the prefix.

    The folder is named by the prefix's fingerprint (every object's relative name, size and ETag / mtime), so
    weights replaced in place (retrained, same shapes, same sizes) make a new snapshot instead of being served
    from the old one; a snapshot is never changed once complete, so a shard still reading the previous one is
    not disturbed. It is built under a name of its own and renamed into place: two fetches at once each build
    their own and the first rename wins."""
    from batch_llm.io.identity import file_fingerprint, stable_hash

    src = as_path(ref, options)
    objects = sorted(((str(obj.relative_to(src)) if hasattr(obj, "relative_to") else obj.name, obj)
                      for obj in src.rglob("*") if not obj.is_dir()), key=lambda t: t[0])
    if not objects:
        raise FileNotFoundError(f"prefix {ref} is empty or missing")
    listing = [{**file_fingerprint(obj), "name": rel} for rel, obj in objects]
    root = Path(cache_dir) / "storage" / hashlib.sha256(ref.encode()).hexdigest()[:16]
    dest = root / stable_hash(listing)[:16]
    if (dest / ".complete").is_file():
        return str(dest), True
    tmp = root / f".{dest.name}.{uuid.uuid4().hex[:8]}.part"
    try:
        for rel, obj in objects:
            target = tmp / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            with obj.open("rb") as fin, open(target, "wb") as fout:
                while block := fin.read(8 << 20):
                    fout.write(block)
        (tmp / ".complete").write_text(json.dumps(listing))
        try:
            os.rename(tmp, dest)
        except OSError:  # another fetch completed the same snapshot first: use it
            if not (dest / ".complete").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("model %s copied into %s (%d files)", ref, dest, len(objects))
    return str(dest), False


class ModelFolderIncomplete(FileNotFoundError):
    """The model folder lacks files the engine needs; the message names the folder and the files."""


class NoChatTemplate(ConfigError):
    """The model has no chat template and ``model.chat_template`` is not set."""


_WEIGHTS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf")
_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_TOKENIZER = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "*.tiktoken")


def _safetensors_problem(path: Path) -> str | None:
    """Why a .safetensors file cannot be whole (cut short, or not safetensors at all), from its header only."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n)) if 0 < n <= size - 8 else None
    except (OSError, ValueError, struct.error):
        header = None
    if not isinstance(header, dict):
        return f"{path.name} (not a safetensors file: a Git LFS pointer or a partial download?)"
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__" and isinstance(t, dict)
               and len(t.get("data_offsets") or ()) == 2), default=0)
    if size < 8 + n + end:
        return f"{path.name} (truncated: {size} of {8 + n + end} bytes)"
    return None


def _weight_problems(root: Path) -> list[str]:
    problems, indexed = [], False
    for name in _INDEXES:
        if not (root / name).is_file():
            continue
        indexed = True
        try:
            shards = sorted(set(json.loads((root / name).read_text(encoding="utf-8"))["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            problems.append(f"{name} (no readable weight_map)")
            continue
        problems += [f"{s} (listed in {name})" for s in shards if not (root / s).is_file()]
    if not indexed and not any(p.is_file() for pattern in _WEIGHTS for p in root.glob(pattern)):
        problems.append(f"the weights (no {', '.join(_WEIGHTS)} file)")
    problems += [q for p in sorted(root.glob("*.safetensors")) if (q := _safetensors_problem(p))]
    return problems


def missing_model_files(directory: str, *, trust_remote_code: bool = False) -> list[str]:
    """What the folder lacks for an engine to load it (empty when nothing): config.json, the weights (every
    shard an index lists, none truncated), a tokenizer. Remote-code models may keep their tokenizer in files of
    their own, so their tokenizer is not looked for."""
    root = Path(directory)
    problems = [] if (root / "config.json").is_file() else ["config.json"]
    problems += _weight_problems(root)
    if not trust_remote_code and not any(p.is_file() for pattern in _TOKENIZER for p in root.glob(pattern)):
        problems.append(f"a tokenizer (none of {', '.join(_TOKENIZER)})")
    return problems


def chat_template_source(directory: str, override: str | None) -> str | None:
    """Where the chat template comes from (``model.chat_template`` or the model's file holding it, as the
    tokenizer will read it), or None when there is none."""
    if override:
        return "model.chat_template"
    root = Path(directory)
    if (root / "chat_template.jinja").is_file():
        return "chat_template.jinja"
    if any((root / "additional_chat_templates").glob("*.jinja")):
        return "additional_chat_templates/"
    try:
        tokenizer_config = json.loads((root / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        tokenizer_config = {}
    return "tokenizer_config.json" if isinstance(tokenizer_config, dict) and tokenizer_config.get("chat_template") \
        else None


def check_model_folder(cfg: ModelConfig, local_dir: str, kind: str) -> str | None:
    """Refuses a folder an engine could not load, or a model without a chat template; returns the template's
    source (for the manifest).

    The chat template is checked here, at fetch, because this is the first stage that sees the model: without
    it every chat row would fail one by one at inference, after an engine start. Fetch does not read the input,
    so it cannot tell whether all rows are pre-tokenized (``prompt_token_ids``, which need no template): chat
    rows are possible in every input, so a missing template is refused unless ``model.require_chat_template``
    is false (input that is all pre-tokenized), where it only warns."""
    missing = missing_model_files(local_dir, trust_remote_code=cfg.trust_remote_code)
    if missing:
        fix = {"modelscope": "delete the folder so that the next fetch downloads the model again",
               "storage": f"add them under {cfg.ref} (the next fetch copies them)"}.get(kind, "copy them into it")
        raise ModelFolderIncomplete(errno.ENOENT, f"model.ref {cfg.ref}: the model folder lacks "
                                    f"{'; '.join(missing)}; {fix}", local_dir)
    source = chat_template_source(local_dir, cfg.chat_template)
    if source is None:
        msg = (f"model.ref {cfg.ref}: the model has no chat template (no chat_template.jinja, none in "
               f"tokenizer_config.json in {local_dir}), so chat rows cannot be rendered; set model.chat_template "
               f"to a Jinja chat template")
        if cfg.require_chat_template:
            raise NoChatTemplate(f"{msg} (or model.require_chat_template: false when every input row is "
                                 f"pre-tokenized: prompt_token_ids)")
        log.warning("%s; model.require_chat_template is false: only pre-tokenized rows will succeed", msg)
    return source


def file_hashes(directory: str) -> list[dict]:
    """Size and SHA-256 of every file; hashes are remembered by (size, mtime, ctime, inode) so a re-fetch costs
    nothing while no file changed."""
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
        # ctime and inode too: a copy tool can carry an old mtime over to new content of the same size, but
        # cannot set the ctime, and a file replaced by a rename has a new inode.
        stamp = f"{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_ino}"
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


def resolve_ref(ref: str, revision: str, cache_dir: str, storage_options: dict | None, *,
                key: str = "model.ref") -> tuple[str, str, bool]:
    """(kind, local folder, cache hit) of a model or adapter ref: ModelScope (cache first), an object-storage
    prefix (copied into the cache) or a local folder."""
    kind = classify_ref(ref, key)
    if kind == "modelscope":
        return kind, *_modelscope_snapshot(ref, revision, cache_dir)
    if kind == "storage":
        return kind, *_sync_from_storage(ref, cache_dir, storage_options or {})
    local_dir = path_policy.resolve(ref).local_path or ""  # the folder the policy checked, as it is opened
    if not os.path.isdir(local_dir):
        raise FileNotFoundError(errno.ENOENT, f"{key} {ref}: no such folder", local_dir)
    return kind, local_dir, True


def content_hash(files: list[dict]) -> str:
    return hashlib.sha256(json.dumps([(f["name"], f["sha256"]) for f in files]).encode()).hexdigest()


def fetch_model(cfg: ModelConfig, *, storage_options: dict | None = None,
                adapter_storage_options: dict | None = None) -> FetchManifest:
    kind, local_dir, hit = resolve_ref(cfg.ref, cfg.revision, cfg.resolved_cache_dir(), storage_options)
    template = check_model_folder(cfg, local_dir, kind)
    files = file_hashes(local_dir)
    content = content_hash(files)
    m = FetchManifest(source=kind, id=cfg.ref, revision=cfg.revision if kind == "modelscope" else None,
                      local_dir=local_dir, cache_hit=hit, chat_template=template, files=files,
                      total_bytes=sum(f["size"] for f in files), content_hash=content,
                      model_key=f"{cfg.ref}@{cfg.revision}#{content[:16]}")
    return with_adapter(cfg, m, adapter_storage_options) if cfg.lora is not None else m


def with_adapter(cfg: ModelConfig, base: FetchManifest, storage_options: dict | None) -> FetchManifest:
    """The manifest with ``model.lora`` applied: the adapter fetched and checked against the model, then merged
    into a new model folder (``merge``, cached by both contents) or recorded for the engine to serve. The model
    key names the adapter either way: the result cache must not answer an adapter's rows with the base's."""
    from batch_llm.stages.lora import check_adapter, merge_adapter, merged_dir

    lora = cfg.lora
    assert lora is not None
    kind, adapter_dir, _ = resolve_ref(lora.ref, lora.revision, cfg.resolved_cache_dir(), storage_options,
                                       key="model.lora.ref")
    info = check_adapter(lora.ref, adapter_dir, base.local_dir)
    adapter_hash = content_hash(file_hashes(adapter_dir))
    record = AdapterRecord(ref=lora.ref, revision=lora.revision if kind == "modelscope" else None, source=kind,
                           local_dir=adapter_dir, content_hash=adapter_hash, rank=info.rank,
                           mode="merge" if lora.merge else "serve")
    if not lora.merge:
        return FetchManifest.model_validate({**base.model_dump(), "adapter": record.model_dump(),
                                             "model_key": f"{base.model_key}+lora#{adapter_hash[:16]}"})
    dest = merged_dir(cfg.resolved_cache_dir(), base.content_hash, adapter_hash)
    hit = merge_adapter(base.local_dir, adapter_dir, dest, trust_remote_code=cfg.trust_remote_code,
                        record={"model": base.model_key, "adapter": record.model_dump(mode="json")})
    template = check_model_folder(cfg, str(dest), "local")
    files = file_hashes(str(dest))
    record = record.model_copy(update={"base_dir": base.local_dir, "merge_cache_hit": hit})
    return FetchManifest.model_validate({
        **base.model_dump(), "local_dir": str(dest), "cache_hit": base.cache_hit and hit, "chat_template": template,
        "files": files, "total_bytes": sum(f["size"] for f in files), "content_hash": content_hash(files),
        "adapter": record.model_dump(), "model_key": f"{base.model_key}+lora-merged#{adapter_hash[:16]}"})


def fetch(cfg: PipelineConfig, layout: RunLayout, *, storage_options: dict | None = None,
          adapter_storage_options: dict | None = None) -> FetchManifest:
    """The model (and its LoRA adapter: merged into a new folder, or recorded for the engine to serve)."""
    t0 = time.perf_counter()
    m = fetch_model(cfg.model, storage_options=storage_options, adapter_storage_options=adapter_storage_options)
    m.seconds = round(time.perf_counter() - t0, 2)
    from batch_llm.stages.infer.identity import reasoning_problems

    # thinking settings this model's template cannot honour stop the run here, before a GPU is leased for it
    if problems := reasoning_problems(cfg, m.local_dir):
        raise ConfigError(f"model.ref {cfg.model.ref}: " + "; ".join(problems))
    if warning := fetch_fit_warning(cfg, m.local_dir):  # a GPU worker whose GPUs cannot hold the model
        logging.getLogger("batch_llm.stages.fetch").warning("%s", warning)
    m.write(layout.stage("fetch").path())
    return m
