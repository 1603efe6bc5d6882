"""The engine worker's child side: ``python -m batch_llm.isolation.worker_child`` (``main``), the process
``batch_llm.isolation.worker_parent.WorkerHandle`` starts. Reads its spec from stdin, runs the shard (or, with ``shards`` in the
spec, a task's shards in turn on one engine), and reports its manifest (``{"shards": [...]}``) as the last
``BATCH_LLM_RESULT {json}`` line of stdout, or ``WORKER_ERROR ...`` and an exit code the parent maps to a retry
or not. The protocol's constants live here, with the side that speaks it; ``batch_llm.isolation.worker_parent`` (the
parent) imports them, never the other way.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from typing import Any

from batch_llm.host.procgroup import live_group_members

RESULT_PREFIX = "BATCH_LLM_RESULT "
# The worker's own messages (the stages' ``say``, batch_llm's loggers) carry these; every other line of its
# output is the engine's (libraries' logs, warnings, the engine core's output): the parent sorts on them
SAY_PREFIX = "BATCH_LLM_SAY "
WARN_PREFIX = "BATCH_LLM_WARN "
EXIT_SHARD_FAILED = 3      # too many error rows, or an engine that cannot run the model here: no retry
EXIT_ERROR = 1


class FastEnd:
    """Reports a committed shard (or a task's committed shards, once the last is durable) and exits at once,
    ending the engine's processes with SIGKILL, as a stop does.

    Once the manifest is durable, vLLM's graceful shutdown and the interpreter's teardown buy nothing; they took
    1.2–1.5 s (between the last result and the merge) and ~2.5 s (after the manifest) of every H200 shard, and
    ~2.3 s of a CPU one (docs/benchmarks.md). Used only where nothing of the engine's
    needs its own cleanup: one device (tensor parallelism shares memory segments between its processes, which
    a kill would leave behind) and this worker leading its own process group (as ``WorkerHandle`` starts it),
    so the kill reaches no one else. vLLM's socket files are left in the folder ``WorkerHandle`` made for this
    attempt, which it removes once the group is gone."""

    def __init__(self, cfg) -> None:
        self.enabled = cfg.engine.tensor_parallel_size == 1 and os.getpgrp() == os.getpid()

    def __call__(self, manifest) -> None:
        report_result(manifest)
        me = os.getpid()
        for pid in live_group_members(me):
            if pid != me:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        sys.stderr.flush()
        os._exit(0)


def report_result(manifest) -> None:
    """The one line ``WorkerHandle`` reads the shard's manifest from; for a task of several shards (a list),
    ``{"shards": [manifest, ...]}``."""
    if isinstance(manifest, list):
        print(RESULT_PREFIX + json.dumps({"shards": [m.model_dump(mode="json") for m in manifest]}), flush=True)
        return
    print(RESULT_PREFIX + manifest.model_dump_json(), flush=True)


def _say(msg: str) -> None:
    for line in str(msg).splitlines() or [""]:
        print(SAY_PREFIX + line, flush=True)


class _PipelineLog(logging.Handler):
    """batch_llm's loggers in the worker: their messages are the pipeline's (what it decided and why), marked
    for the task log, warnings as warnings."""

    def emit(self, record: logging.LogRecord) -> None:
        prefix = WARN_PREFIX if record.levelno >= logging.WARNING else SAY_PREFIX
        try:
            for line in self.format(record).splitlines() or [""]:
                print(prefix + line, flush=True)
        except Exception:  # noqa: BLE001 - logging's own rule: a failed log line never fails the caller
            self.handleError(record)


def _log_setup() -> None:
    """Every other library logs on stdout with its level and name, so the parent can tell a warning and its source;
    Python's warnings go through logging (py.warnings), one record each."""
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.captureWarnings(True)
    ours = logging.getLogger("batch_llm")
    ours.addHandler(_PipelineLog())
    ours.propagate = False


def _die_with_parent() -> None:
    """If the task process is killed -9, the worker must not live on holding a GPU (Linux only)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def main() -> int:
    started = time.time()
    _die_with_parent()
    # On SIGTERM end the whole group, engine processes included, then exit.
    signal.signal(signal.SIGTERM, lambda *_: (os.killpg(os.getpgrp(), signal.SIGKILL)))
    _log_setup()
    spec = json.loads(sys.stdin.read())
    from batch_llm.api import infer_shard, infer_shards
    from batch_llm.config import parse_config
    from batch_llm.engines.base import EngineCannotRun
    from batch_llm.layout import RunLayout
    from batch_llm.stages.infer.runner import ShardFailed

    cfg = parse_config(spec["config"], "worker spec")
    layout = RunLayout.from_dict(spec["layout"])
    fast_end = FastEnd(cfg)
    try:
        say, clock = _say, {"spawned_at": spec.get("spawned_at"), "worker_started_at": started}
        on_committed = fast_end if fast_end.enabled else None
        stage = spec.get("stage", "infer")  # review: the content review's pass (stages.review)
        if "shards" in spec:  # a task of several shards: one engine serves them in turn
            result: Any = infer_shards(cfg, layout, spec["model"], spec["shards"], say=say, started=clock,
                                       on_committed=on_committed, stage=stage)
        else:
            result = infer_shard(cfg, layout, spec["model"], spec["shard"], say=say, started=clock,
                                 on_committed=on_committed, stage=stage)
    except (ShardFailed, EngineCannotRun) as e:
        print(f"WORKER_ERROR {e}", flush=True)
        return EXIT_SHARD_FAILED
    except Exception as e:  # noqa: BLE001 - reported to the parent, which decides on retries
        import traceback

        for line in traceback.format_exc().splitlines():  # the failure is the pipeline's news: the task log
            _say(line)
        print(f"WORKER_ERROR {type(e).__name__}: {e}", flush=True)
        return EXIT_ERROR
    report_result(result)
    return 0


if __name__ == "__main__":  # as WorkerHandle.start runs it
    sys.exit(main())
