#!/usr/bin/env bash
# Sets up everything on a fresh machine, idempotently: the two virtual environments (pinned by the lock
# files), the Debian packages the heavier tests use, and the offline demo model.
# Environment: TORCH_FIND_LINKS — where torch==2.13.0+cpu lies (default /opt/wheels; elsewhere use
# PyTorch's CPU index through UV_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
command -v uv >/dev/null || python3 -m pip install -q uv
FL=()
[ -d "${TORCH_FIND_LINKS:-/opt/wheels}" ] && FL=(--find-links "${TORCH_FIND_LINKS:-/opt/wheels}")
export UV_INDEX_STRATEGY=unsafe-best-match UV_LINK_MODE=${UV_LINK_MODE:-copy}

make_env() {  # make_env DIR LOCKFILE
  local dir=$1 lock=$2 stamp=$1/.lock.sha
  local want; want=$(sha256sum "$lock" pyproject.toml | sha256sum | cut -c1-16)
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then return; fi
  echo "setup: building $dir from $lock"
  [ -x "$dir/bin/python" ] || uv venv -q --python "${PYTHON:-python3.11}" "$dir"
  uv pip sync -q --python "$dir/bin/python" "${FL[@]}" "$lock"
  uv pip install -q --python "$dir/bin/python" --no-deps -e .
  echo "$want" > "$stamp"
}
make_env .venv requirements.lock
make_env .venv-quantize requirements-quantize.lock
echo "setup: environments ready"
