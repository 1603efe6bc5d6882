"""Batch inference over one shard, or one task's shards on one engine, one module per concern. A shard's rows go
through them as a chain: rows → requests (``request_builder``) → engine (``runner``) → result rows (``results``)
→ committed chunks and the manifest (``commit``).

- ``tasks``: the plan's shards grouped into inference tasks, a task's shards run in turn on one engine
- ``runner``: one shard's read → cache → generate → commit → finish loop, the engine it starts or shares
- ``request_builder``: a row on its way to the engine: chat template, tokenizer, length checks, images, the
  local spool of requests
- ``results``: result and error rows, the sample and reasoning fields, schema checks and the outputs asked again
- ``commit``: finished rows written as immutable chunks, merged into the shard's outputs and errors, the manifest
  written last; the checkpoints around each write
- ``identity``: what changes an output (the result cache's namespace, a shard's resume key), the reasoning parser
  the engine gets, a shard folder made from other inputs started over
"""
