"""The inference engines behind one interface, and what each serves.

- ``base``: the interface every engine implements (start, generate a stream of requests, close) and the request
  and result types
- ``capabilities``: the capability table (who serves guided JSON, n > 1, logprobs, LoRA, ...), importable without
  importing any engine
- ``registry``: which class serves each ``engine.kind``
- ``start``: engine start for a shard, with memory back-off
- one module per engine (``vllm_engine``, ``sglang_engine``, ``lmdeploy_engine``, ``transformers_engine``) and the
  config translations that need no engine import (``lmdeploy_config``, ``sglang_config``)
- ``output_capture``: capturing the engines' processes' output
"""
