#!/usr/bin/env bash
# On the lent H200, after ../shared/gpu's stage_a.sh / run_b.sh have put vLLM 0.26 into /root/site:
#   bash bench/gpu_run.sh fixed|mix|checks
# Carry .gpu-stage/extra (universal-pathlib wheels, with_vllm.sh). Results land in $OUT.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --target /root/site .gpu-stage/extra/*.whl 2>&1 | grep -v WARNING
export PYTHONPATH=/root/site:$PWD/include VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 \
  TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
M=/root/work/qwen7b_cfg
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
case "${1:-fixed}" in
  fixed) timeout 540 python3 bench/bench_inference.py --model $M --dummy --dataset fixed --n 1000 --modes raw,stage,hf \
           --hf-n 128 --hf-batch 32 --out $OUT/gpu.jsonl ;;
  mix)   timeout 540 python3 bench/bench_inference.py --model $M --dummy --dataset mix --n 2000 --modes raw,stage \
           --out $OUT/gpu.jsonl ;;
  checks) timeout 540 python3 bench/gpu_checks.py --model $M --dummy stop resume | tee $OUT/checks.txt ;;
esac
