"""batch_llm, the stage library: plain Python, no Airflow; runs in Airflow tasks, the CLI, on a GPU host and in tests.

Start at ``api`` (one function per stage) and ``config`` (the one config model); ``layout`` says where a run
reads and writes, ``manifests`` what each stage hands the next. The packages, by concern: ``stages`` (one module
per stage), ``engines`` (vLLM, SGLang, LMDeploy, transformers behind one interface), ``isolation`` (a shard in a
worker process of its own, on leased GPUs), ``host`` (GPUs, process groups, the path policy, model-folder probes),
``io`` (storage, formats, the current pointer), ``cache``, ``sinks`` (Delta and Iceberg tables), ``analysis`` (run
statistics, the doctor, the report), ``sizing`` and ``frontends`` (the command line, ms-swift's and vLLM's flags,
common-ai's conventions).
"""
