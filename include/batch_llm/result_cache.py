"""The result cache: generated rows keyed by content, in object storage, safe under concurrent shards.

A key hashes everything that decides an output: the model (id, revision, content hash, quantization), the
chat template, the sampling parameters and the prompt that is rendered (chat messages or token ids). Entries are written as
immutable segment files with unique names (one per committed chunk), so concurrent shards never write the
same object, and a reader simply takes the union. A hit is only ever a byte-exact earlier result for the
same key.
"""
from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Iterable

from batch_llm.storage import Location, iter_jsonl, list_files, write_jsonl


def namespace(*, model_key: str, chat_template: str, sampling: dict, engine_kind: str) -> str:
    """Hash of what is shared by every row of a run; changing any of it misses the cache."""
    blob = json.dumps({"model": model_key, "template": chat_template, "sampling": sampling,
                       "engine": engine_kind}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def prompt_key(prompt: list | dict, max_tokens: int | None = None) -> str:
    """What is rendered: the chat messages (the template is in the namespace) or pre-tokenized ids, plus a
    row's own max_tokens when it sets one."""
    blob = json.dumps(prompt if max_tokens is None else [prompt, max_tokens], sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()


class ResultCache:
    def __init__(self, root: Location, ns: str):
        self.dir = root.child(ns)

    def lookup(self, keys: Iterable[str]) -> dict[str, dict]:
        """The cached results for the wanted keys (reads every segment, keeps only what is asked)."""
        wanted = set(keys)
        found: dict[str, dict] = {}
        if not wanted:
            return found
        for seg in list_files(self.dir.path(), ".jsonl"):
            for entry in iter_jsonl(seg):
                k = entry.get("key")
                if k in wanted and k not in found:
                    found[k] = entry
            if len(found) == len(wanted):
                break
        return found

    def add(self, entries: list[dict]) -> None:
        """Writes one new immutable segment (entries: key, output, finish_reason, token counts)."""
        if entries:
            write_jsonl(self.dir.child(f"seg-{uuid.uuid4().hex}.jsonl").path(), entries)
