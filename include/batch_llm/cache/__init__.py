"""Caches that outlive a run.

- ``results``: the result cache (prompt + every output-deciding setting → output), sorted-string tables in storage
- ``compile``: vLLM's compilation cache kept in storage, so engines on fresh workers start warm
"""

__all__ = ["compile", "results"]
