"""Ways in other than the Airflow DAG: the command line and the translations from other tools.

- ``cli``: ``batch-llm validate | run | run-shard | report | doctor | recommend | infer ...``
- ``swift``: ms-swift's ``swift infer`` flags mapped onto the pipeline config (``batch-llm infer``)
- ``run_batch``: ``batch-llm run-batch``: vLLM run-batch's flags over an OpenAI Batch file, no YAML
- ``written_config``: a config one of those wrote, run through ``batch-llm run``'s own function
- ``common_ai``: the library side of ``@task.gpu_llm_batch`` (Airflow common-ai's ``LLMBatchOperator``
  conventions: prompts in, one manifest out)
"""

__all__ = ["cli", "common_ai", "run_batch", "swift", "written_config"]
