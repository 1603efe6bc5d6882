# The two commands: `make demo` (set up everything, run the demo pipeline through Airflow) and `make test`.
.PHONY: setup demo test check bench lock
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
lock:
	bash .ci/lock.sh
