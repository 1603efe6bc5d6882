#!/usr/bin/env bash
# The quick loop (`make check`, under 3 minutes): ruff (lint, import order, complexity <= 12), mypy on include/ and
# bench/ (every function body checked, check_untyped_defs, no module excused: [tool.mypy] in pyproject.toml; its
# cache in .cache/mypy) and tests/unit, the tests that start no engine and no service (tests/system: the rest), on
# two xdist workers as `make test` runs them (tests/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check .
.venv/bin/mypy
exec .venv/bin/python -m pytest -p no:cacheprovider -q -n "${TEST_WORKERS:-2}" --dist loadfile tests/unit "$@"
