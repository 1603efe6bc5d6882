"""A pipeline config that a front-end wrote (``batch-llm infer``, ``batch-llm run-batch``) run through
``batch-llm run``'s own function: today's partition, a run id of the front-end's own. ``run`` is handed in
(``cli.cmd_run``) because the command line imports the front-ends."""
from __future__ import annotations

import argparse
import datetime as dt
import shutil
import sys
from collections.abc import Callable
from pathlib import Path


def run_written_config(config_path: Path, run: Callable[[argparse.Namespace], int], outer: argparse.Namespace, *,
                       run_prefix: str, plain: bool, verbose: bool, temporary: bool = False) -> tuple[int, str]:
    """Returns the run's exit code and its ``ds``. The run's log file is named on ``outer`` (the front-end's
    own arguments), which ``cli.main`` reports when the command fails. ``temporary``: the config's output lies in
    a work folder removed at the end, so the run does not print its published files' paths (the front-end says
    where what it keeps went)."""
    ds = dt.date.today().isoformat()
    run_args = argparse.Namespace(command="run", config=str(config_path), overrides=[], input=None, output=None,
                                  ds=ds, run_id=f"{run_prefix}__{dt.datetime.now().strftime('%Y%m%dT%H%M%S%f')}",
                                  plain=plain, verbose=verbose, argv=["run", str(config_path), "--ds", ds],
                                  published_paths=not temporary)
    rc = run(run_args)
    if getattr(run_args, "log_file", None):
        outer.log_file = run_args.log_file
    return rc, ds


def keep_work_folder(work: Path, *, keep: bool, started: bool, finished: bool) -> None:
    """Removes a temporary work folder, unless a run started there and the command did not finish: then what the
    run finished (its published results, its log, its committed shards) stays, and the folder is named."""
    if keep:
        return
    if started and not finished:
        print(f"note: the run's work folder is kept: {work} (its published results under {work / 'output'}, "
              f"its logs under its runs/ folder)", file=sys.stderr)
        return
    shutil.rmtree(work, ignore_errors=True)

