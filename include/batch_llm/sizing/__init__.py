"""How big a machine a job needs, before it runs.

- ``recommend``: ``batch-llm recommend``: whether a model fits, at which tensor-parallel size, the expected wall
  time and GPU-hours
- ``inputs``: what sizing reads (the model's config, the worker's GPUs) and the fetch stage's fit warning
"""

__all__ = ["inputs", "recommend"]
