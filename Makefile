# The two commands: `make demo` (set up everything, run the demo pipeline through Airflow) and `make test`.
.PHONY: setup demo test check bench gpu-check lock
setup:
	bash scripts/setup.sh
demo: setup
	bash scripts/demo.sh
test: setup
	bash scripts/test.sh
check: setup
	bash scripts/check.sh
bench: setup
	bash bench/run_cpu.sh
# On a machine with one GPU, in an environment with the GPU vLLM (`pip install -e ".[vllm,transformers,fetch,report,lora]"`
# or the GPU image; the quantize extra conflicts with vllm: a venv of its own, named by BATCH_LLM_QUANTIZE_PYTHON):
# every feature through `batch-llm run` on the real demo weights (docs/benchmarks.md, "GPU check").
PYTHON ?= .venv/bin/python
gpu-check:
	PYTHONPATH=.:$$PYTHONPATH $(PYTHON) -m bench gpu-check --out var/gpu-check
lock:
	bash .ci/lock.sh
