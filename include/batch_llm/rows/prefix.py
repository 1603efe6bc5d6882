"""A prompt's prefix, as the bytes and groups the planner orders rows by: rows whose prompts agree on their first
64 bytes share a group at that level, inside it on 512, and so on (a shared system prompt or template, a document
asked several questions, a few-shot block, each at the level its length reaches). The plan groups rows by them
(``sharding.group_prefixes``); the output-length history (``cache/lengths.py``) keys what earlier runs generated
by the first two."""
from __future__ import annotations

import json
import zlib
from array import array
from collections.abc import Sequence

PREFIX_LEVELS = (64, 512, 4096, 32768)


def prompt_bytes(text: str | None, messages: Sequence[dict] | None, token_ids: Sequence[int] | None,
                 cap: int = PREFIX_LEVELS[-1]) -> bytes:
    """A prompt as the bytes its prefix is told from: the token ids (8 bytes each), the completion text, or the
    messages' roles and parts in order (an image part by its hash or reference, so two questions about one image
    share it); of a long prompt at least its first ``cap`` bytes (the deepest level read), not all of it."""
    if token_ids:
        return array("q", token_ids[:cap // 8]).tobytes()
    if text is not None:
        return text[:cap].encode()  # a character is at least a byte
    out: list[bytes] = []
    size = 0
    for m in messages or ():
        if size >= cap:
            break
        out.append(str(m.get("role")).encode() + b"\0")
        content = m.get("content")
        for part in content if isinstance(content, list) else [content]:
            if isinstance(part, dict) and part.get("type") == "text":
                out.append(str(part.get("text") or "").encode())
            elif isinstance(part, dict):
                out.append(json.dumps(part, separators=(",", ":"), ensure_ascii=False, default=str).encode())
            elif part is not None:
                out.append(str(part).encode())
        out.append(b"\1")
        size = sum(map(len, out))
    return b"".join(out)


def prefix_groups(data: bytes, levels: Sequence[int] = PREFIX_LEVELS) -> tuple[int, ...]:
    """The CRC-32 of ``data``'s first n bytes for each n of ``levels`` (a collision only merges two groups); 0 where
    ``data`` is shorter than n: no group at that level."""
    return tuple(zlib.crc32(data[:n]) if len(data) >= n else 0 for n in levels)
