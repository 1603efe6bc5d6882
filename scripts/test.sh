#!/usr/bin/env bash
# Runs the whole test suite (unit, end-to-end on the real vLLM engine, Airflow runs) in the project's venv.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m batch_llm.demo_model >/dev/null   # cached after the first build
exec .venv/bin/python -m pytest -p no:cacheprovider --durations=20 "$@"
