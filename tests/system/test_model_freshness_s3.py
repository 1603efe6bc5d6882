"""A model in object storage replaced in place is fetched again, on a real S3 server
(SeaweedFS ``weed mini`` on loopback, fixture ``s3``).

A storage prefix is copied into one snapshot folder per state of the prefix (every object's name, size and
ETag): retrained weights of the same size are a new snapshot and a new model key, never a cache hit on the old
copy, and the old snapshot stays as it was for a shard still reading it. Two fetches at once build under names
of their own; the first rename wins and both use that folder.
"""
from __future__ import annotations

import hashlib
import json
import struct
import threading
from pathlib import Path

from batch_llm.config import ModelConfig
from batch_llm.stages import fetch
from batch_llm.stages.fetch import fetch_model

OLD_WEIGHTS = bytes(range(64))
NEW_WEIGHTS = bytes(reversed(range(64)))  # retrained: same shape, same size, other values


def safetensors_bytes(payload: bytes) -> bytes:
    """A valid one-tensor .safetensors file (uint8 vector) holding ``payload``."""
    header = json.dumps({"w": {"dtype": "U8", "shape": [len(payload)], "data_offsets": [0, len(payload)]}}).encode()
    return struct.pack("<Q", len(header)) + header + payload


def upload_model(s3, prefix: str, weights: bytes) -> str:
    """The smallest model fetch's checks accept, under ``prefix``; returns its s3:// ref."""
    files = {"config.json": json.dumps({"model_type": "llama"}).encode(), "model.safetensors": safetensors_bytes(weights),
             "tokenizer.json": b"{}", "tokenizer_config.json": json.dumps({"chat_template": "{{ messages }}"}).encode()}
    client = s3.client()
    for name, body in files.items():
        client.put_object(Bucket=s3.bucket, Key=f"{prefix}/{name}", Body=body)
    return f"s3://{s3.bucket}/{prefix}"


def folder_bytes(folder: str) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def test_weights_replaced_with_same_size_bytes_are_a_new_snapshot(s3, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # file_hashes' memo: the test's own
    cfg = ModelConfig(ref=upload_model(s3, "models/fresh-inplace", OLD_WEIGHTS), cache_dir=str(tmp_path / "cache"))
    opts = s3.storage_options()

    first = fetch_model(cfg, storage_options=opts)
    assert first.source == "storage" and not first.cache_hit
    again = fetch_model(cfg, storage_options=opts)
    assert again.cache_hit and again.local_dir == first.local_dir and again.model_key == first.model_key
    old_snapshot = folder_bytes(first.local_dir)

    key = "models/fresh-inplace/model.safetensors"
    old_head = s3.client().head_object(Bucket=s3.bucket, Key=key)
    s3.client().put_object(Bucket=s3.bucket, Key=key, Body=safetensors_bytes(NEW_WEIGHTS))
    new_head = s3.client().head_object(Bucket=s3.bucket, Key=key)
    assert new_head["ContentLength"] == old_head["ContentLength"] and new_head["ETag"] != old_head["ETag"]

    third = fetch_model(cfg, storage_options=opts)
    assert not third.cache_hit
    assert third.local_dir != first.local_dir
    assert third.content_hash != first.content_hash and third.model_key != first.model_key
    assert (Path(third.local_dir) / "model.safetensors").read_bytes() == safetensors_bytes(NEW_WEIGHTS)
    assert {f.name: f.sha256 for f in third.files}["model.safetensors"] == \
        hashlib.sha256(safetensors_bytes(NEW_WEIGHTS)).hexdigest()
    assert folder_bytes(first.local_dir) == old_snapshot  # a shard still reading the old one is not disturbed

    fourth = fetch_model(cfg, storage_options=opts)
    assert fourth.cache_hit and fourth.local_dir == third.local_dir and fourth.model_key == third.model_key


def test_two_fetches_at_once_share_one_snapshot_and_leave_no_part_folder(s3, tmp_path, monkeypatch):
    """Both fetches are made to be copying at the same time: each opens its first file for writing, then
    waits for the other to have done the same."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    cache = tmp_path / "cache"
    cfg = ModelConfig(ref=upload_model(s3, "models/fresh-race", OLD_WEIGHTS), cache_dir=str(cache))
    opts = s3.storage_options()

    both_copying = threading.Barrier(2, timeout=30)
    met = threading.local()
    real_open = open

    def open_then_meet(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        if "w" in mode and not getattr(met, "done", False):
            met.done = True
            both_copying.wait()
        return f

    monkeypatch.setattr(fetch, "open", open_then_meet, raising=False)  # fetch's module globals, not builtins
    results: dict[int, object] = {}

    def run(i: int) -> None:
        try:
            results[i] = fetch_model(cfg, storage_options=opts)
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    errors = {i: r for i, r in results.items() if isinstance(r, BaseException)}
    assert not errors, {i: f"{type(e).__name__}: {e}" for i, e in errors.items()}
    a, b = results[0], results[1]
    assert not a.cache_hit and not b.cache_hit  # both copied (each passed the barrier)
    assert a.local_dir == b.local_dir and a.content_hash == b.content_hash
    assert (Path(a.local_dir) / "model.safetensors").read_bytes() == safetensors_bytes(OLD_WEIGHTS)
    leftovers = [str(p) for p in cache.rglob("*") if p.name.endswith(".part")]
    assert leftovers == []
