#!/usr/bin/env bash
# The quick loop (`make check`, a few minutes): ruff (lint, import order, complexity <= 12) and the tests that
# start no engine and no service. `make test` runs everything, these included.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -p no:cacheprovider -q \
  tests/test_config.py tests/test_formats_plan.py tests/test_scale.py tests/test_report_doctor.py \
  tests/test_engine_streaming.py tests/test_gpu_lease.py tests/test_setup_script.py tests/test_dag_integrity.py \
  tests/test_result_cache.py -k "not real_engine" "$@"
