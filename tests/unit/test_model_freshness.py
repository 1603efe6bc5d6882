"""A local model folder whose weights are rewritten in place is hashed again.

``file_hashes`` remembers each file's SHA-256 under a stamp so that a re-fetch costs nothing. A stamp of size and
mtime alone let retrained weights of the same shape, written by a tool that carries the old mtime over (``cp -p``,
``rsync -t``, an unpacked archive), keep the old hash: the run's model key named weights it did not run. The stamp
now holds the ctime and inode too, which no copy tool can carry over.

The memo lives under ``~/.cache/batch_llm/hashes``: HOME points into the test's folder, so the memo is its own.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import time
from pathlib import Path

import pytest
from batch_llm.config import ModelConfig
from batch_llm.stages.fetch import fetch_model

OLD_WEIGHTS = bytes(range(64))
NEW_WEIGHTS = bytes(reversed(range(64)))  # retrained: same shape, same size, other values


def safetensors_bytes(payload: bytes) -> bytes:
    """A valid one-tensor .safetensors file (uint8 vector) holding ``payload``."""
    header = json.dumps({"w": {"dtype": "U8", "shape": [len(payload)], "data_offsets": [0, len(payload)]}}).encode()
    return struct.pack("<Q", len(header)) + header + payload


def write_model(folder: Path, weights: bytes) -> Path:
    """The smallest folder fetch's checks accept: config, weights, a tokenizer file and a chat template."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (folder / "model.safetensors").write_bytes(safetensors_bytes(weights))
    (folder / "tokenizer.json").write_text("{}")
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    return folder


@pytest.mark.parametrize("how", ["rewritten_in_place", "replaced_by_rename"])
def test_same_size_weights_with_the_old_mtime_get_a_new_content_hash(tmp_path, monkeypatch, how):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    model = write_model(tmp_path / "model", OLD_WEIGHTS)
    cfg = ModelConfig(ref=str(model), cache_dir=str(tmp_path / "cache"))
    first = fetch_model(cfg)
    assert fetch_model(cfg).content_hash == first.content_hash  # unchanged folder: the memo answers
    assert list((tmp_path / "home" / ".cache" / "batch_llm" / "hashes").glob("*.json"))  # the test's own memo

    weights = model / "model.safetensors"
    before = weights.stat()
    time.sleep(0.05)  # a retrain takes longer than the filesystem's timestamp tick: the ctime moves on
    new = safetensors_bytes(NEW_WEIGHTS)
    if how == "rewritten_in_place":
        weights.write_bytes(new)
    else:
        (model / ".model.safetensors.tmp").write_bytes(new)
        os.replace(model / ".model.safetensors.tmp", weights)
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))  # as cp -p / rsync -t leave it
    after = weights.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)  # what the old stamp held
    assert (after.st_ino == before.st_ino) == (how == "rewritten_in_place")

    second = fetch_model(cfg)
    assert second.content_hash != first.content_hash and second.model_key != first.model_key
    recorded = {f.name: f.sha256 for f in second.files}
    assert recorded["model.safetensors"] == hashlib.sha256(new).hexdigest()
    assert second.local_dir == first.local_dir and second.total_bytes == first.total_bytes
