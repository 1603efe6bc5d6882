# Sourced by the demo, the tests' helpers and by hand: an Airflow home inside the checkout (SQLite,
# LocalExecutor), with this project's dags/ and plugins/. Override any variable before sourcing. The packages
# (batch_llm, batch_llm_airflow: provider and plugin entry points) come from .venv's install, no PYTHONPATH.
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export AIRFLOW_HOME=${AIRFLOW_HOME:-$ROOT/var/airflow}
export AIRFLOW__CORE__DAGS_FOLDER=${AIRFLOW__CORE__DAGS_FOLDER:-$ROOT/dags}
export AIRFLOW__CORE__PLUGINS_FOLDER=${AIRFLOW__CORE__PLUGINS_FOLDER:-$ROOT/plugins}
export AIRFLOW__CORE__LOAD_EXAMPLES=False
export AIRFLOW__CORE__EXECUTOR=${AIRFLOW__CORE__EXECUTOR:-LocalExecutor}
export AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION=${AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION:-True}
export AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=${AIRFLOW__DATABASE__SQL_ALCHEMY_CONN:-sqlite:///$AIRFLOW_HOME/airflow.db}
export AIRFLOW__CORE__UNIT_TEST_MODE=${AIRFLOW__CORE__UNIT_TEST_MODE:-False}
export BATCH_LLM_MODEL_CACHE=${BATCH_LLM_MODEL_CACHE:-$ROOT/.cache/modelscope}
export MODELSCOPE_CACHE=${MODELSCOPE_CACHE:-$BATCH_LLM_MODEL_CACHE}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
mkdir -p "$AIRFLOW_HOME"
