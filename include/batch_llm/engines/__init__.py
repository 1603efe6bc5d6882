"""The inference engines behind one interface (what each serves is the capability table, ``config/capabilities.py``).

- ``base``: the interface every engine implements (start, generate a stream of requests, close) and the request
  and result types
- ``registry``: which class serves each ``engine.kind``
- ``start``: engine start for a shard, with memory back-off
- one module per engine (``vllm_engine``, ``sglang_engine``, ``lmdeploy_engine``, ``transformers_engine``) and the
  config translations that need no engine import (``lmdeploy_config``, ``sglang_config``)
- ``output_capture``: capturing the engines' processes' output
"""
