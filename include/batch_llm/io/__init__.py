"""Reading and writing rows and files, wherever they live (a local folder or S3-compatible storage).

- ``storage``: ``Location`` (a URL plus its storage options), atomic writes, JSON/JSONL helpers, listing, removal
- ``formats``: the input and output formats (JSONL, Parquet, CSV, OpenAI Batch): rows in, rows out
- ``current_pointer``: a partition's ``_CURRENT.json``, switched by compare-and-swap
- ``retention``: which folders publish may delete (proven retired versions, old orphans), and only those
- ``identity``: stable hashes of settings and files (what keys a plan, a shard, a cache entry)
"""

__all__ = ["current_pointer", "formats", "identity", "retention", "storage"]
