"""Every pipeline under dags/pipelines/ (or $BATCH_LLM_PIPELINES_DIR) becomes a DAG:

    fetch_model → quantize → batch_inference × N (mapped over plan_shards) → content_filter
    → evaluate → publish (Asset batch_llm.<name>)

except a pipeline file with a DAG file of its own beside it (dags/pipelines/demo.py), which builds it there.
"""
from pathlib import Path

from batch_llm_airflow.dag_factory import build_pipeline_dags, pipelines_dir

here = Path(__file__).parent
globals().update(build_pipeline_dags(pipelines_dir(here / "pipelines"), dag_folder=here))
