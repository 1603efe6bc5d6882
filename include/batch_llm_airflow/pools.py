"""The Airflow pools the pipelines' GPU tasks run in, created through Airflow's own CLI (``airflow pools set``).

A scheduler leaves a task whose pool does not exist, or has fewer slots than the task takes, scheduled for ever
(it only logs it), and a DAG file cannot create a pool (Airflow 3 parses DAGs without the metadata database).
So whatever starts a scheduler creates them first: ``scripts/demo.sh``, compose's ``airflow-init``
(``docker/airflow-init.sh``), or by hand:

    python -m batch_llm_airflow.pools --slots 8 dags/pipelines    # prints and runs the `airflow pools set` lines
    python -m batch_llm_airflow.pools --dry-run dags/pipelines    # prints them only

Each pool a pipeline names (``airflow.gpu_pool``) gets ``--slots`` slots (the GPUs of the workers of its queue),
at least as many as its largest task takes: the ``tensor_parallel_size`` of the pipeline's engine, or of its
content review's. An invalid pipeline file is skipped (its DAG reports it).
"""
from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path

from batch_llm.config import ConfigError, PipelineConfig, load_config

DESCRIPTION = "batch-llm GPU slots: the GPUs of the GPU queue workers; a task takes tensor_parallel_size slots"


def task_slots(cfg: PipelineConfig) -> int:
    """The most pool slots one of the pipeline's GPU tasks takes (its engine's GPUs, or the review engine's)."""
    review = cfg.filter.review.engine.tensor_parallel_size if cfg.filter.review is not None else 1
    return max(cfg.engine.tensor_parallel_size, review)


def pipeline_pools(folders: list[Path]) -> dict[str, int]:
    """Pool name: the most slots one task of the valid pipeline files of ``folders`` takes in it."""
    pools: dict[str, int] = {}
    for folder in folders:
        for path in sorted(Path(folder).glob("*.y*ml")):
            try:
                cfg = load_config(path)
            except ConfigError as e:
                print(f"pools: skipping {path.name}: invalid pipeline file ({str(e).splitlines()[0]})", file=sys.stderr)
                continue
            pool = cfg.airflow.gpu_pool
            pools[pool] = max(pools.get(pool, 1), task_slots(cfg))
    return pools


def pool_commands(pools: dict[str, int], slots: int, airflow: str = "airflow") -> list[list[str]]:
    """The ``airflow pools set`` command of each pool: ``slots`` slots, or as many as its largest task takes."""
    return [[airflow, "pools", "set", name, str(max(slots, need)), DESCRIPTION] for name, need in sorted(pools.items())]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m batch_llm_airflow.pools", description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", type=Path, help="pipeline folders (dags/pipelines, "
                        "$BATCH_LLM_PIPELINES_DIR)")
    parser.add_argument("--slots", type=int, default=1, help="slots of each pool: the GPUs of the GPU workers")
    parser.add_argument("--pool", action="append", default=[], help="a pool to create even where no pipeline "
                        "names it yet (the deployment's default, airflow.gpu_pool)")
    parser.add_argument("--airflow", default="airflow", help="the airflow command")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run none")
    args = parser.parse_args(argv)
    pools = {name: 1 for name in args.pool} | pipeline_pools(args.folders)
    for cmd in pool_commands(pools, max(1, args.slots), args.airflow):
        print("pools: " + shlex.join(cmd))
        if not args.dry_run:
            done = subprocess.run(cmd, stdout=subprocess.DEVNULL, check=False)
            if done.returncode:
                print(f"pools: `{shlex.join(cmd[:4])}` exited with {done.returncode}", file=sys.stderr)
                return done.returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
