"""The benchmarks: one package, one command line (``python -m bench COMMAND ...``; ``python -m bench --help``
lists the commands), the runners they share in ``bench/runners.py``. Results: docs/benchmarks.md.

Nothing here imports Airflow, and no module imports an engine at module level: the GPU machine that runs them
has vLLM (or LMDeploy) and the stage library (``include/`` on PYTHONPATH), nothing else.
"""
