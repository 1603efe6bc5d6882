"""Airflow DAG file of the pipeline in review_extraction.yaml beside it: an invalid pipeline file is this file's import error."""
from batch_llm_airflow.dag_factory import pipeline_file_dags

globals().update(pipeline_file_dags(__file__))
