"""Caches that outlive a run.

- ``results``: the result cache (prompt + every output-deciding setting → output): writing and maintenance
- ``table``: its sorted-string table format, written and read in batched ranges
- ``lookup``: a lookup of many keys against a namespace's tables
- ``merge``: compaction's merge of tables into one, in blocks, in bounded memory
- ``lengths``: the output lengths earlier runs generated per prompt prefix group: the plan's order
- ``compile``: vLLM's compilation cache kept in storage, so engines on fresh workers start warm
"""

__all__ = ["compile", "lengths", "lookup", "merge", "results", "table"]
