"""Caches that outlive a run.

- ``results``: the result cache (prompt + every output-deciding setting → output): writing and maintenance
- ``table``: its sorted-string table format, written and read in batched ranges
- ``lookup``: a lookup of many keys against a namespace's tables
- ``merge``: compaction's merge of tables into one, in blocks, in bounded memory
- ``compile``: vLLM's compilation cache kept in storage, so engines on fresh workers start warm
"""

__all__ = ["compile", "lookup", "merge", "results", "table"]
