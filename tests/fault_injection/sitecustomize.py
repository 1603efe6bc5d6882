"""Fault injection for the resume tests, loaded only into processes whose PYTHONPATH names this folder.

The shard runner and the table sinks announce their checkpoints as audit events (``sys.audit(CHECKPOINT_EVENT,
point)``; a sink's ``before_table_commit``: its data files written, its commit not made), which cost nothing when
nobody listens. Here a listener kills its own process with SIGKILL at a checkpoint: a worker
dying at the worst moment. Two ways to ask for it:

- ``BATCH_LLM_FAULT="after_commit:2"``: every process so started dies the 2nd time it reaches that checkpoint;
- ``BATCH_LLM_FAULT_FILE=PATH``, the file holding ``after_commit 2 dt=2026-11-28``: the next 2 processes to
  reach that checkpoint in a shard folder whose URL contains the third word (optional) die there (each at its
  first), the count kept in the file; an absent file asks for nothing. For services that start many workers,
  where only one run's should die (tests/system/test_rest_backfill.py).

And one way to hold a worker still rather than kill it: ``BATCH_LLM_HOLD_FILE=PATH``, the file holding a checkpoint
name (``after_commit``): a process reaching that checkpoint waits there while the file exists and still names it
(a shard that has committed its first chunk and goes no further until the test says so:
tests/system/test_openai_batch_api.py cancels and expires batches so, mid-shard).
"""
import os
import signal
import sys
import time

# the names in batch_llm/stages/infer/commit.py (a shard's checkpoints) and batch_llm/sinks/base.py (a table commit's)
CHECKPOINT_EVENTS = ("batch_llm.shard.checkpoint", "batch_llm.sink.checkpoint")
_spec = os.environ.get("BATCH_LLM_FAULT", "")
_point, _, _nth = _spec.partition(":")
_file = os.environ.get("BATCH_LLM_FAULT_FILE", "")
_seen = 0


def _kill_at_the_nth_checkpoint(event: str, args: tuple) -> None:
    global _seen
    if event not in CHECKPOINT_EVENTS or args[0] != _point:
        return
    _seen += 1
    if _seen == int(_nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)


def _kill_while_the_file_counts(event: str, args: tuple) -> None:
    if event not in CHECKPOINT_EVENTS:
        return
    try:
        with open(_file) as fh:
            point, count, *where = fh.read().split()
    except (OSError, ValueError):
        return
    shard_dir = args[1] if len(args) > 1 else ""
    if args[0] != point or int(count) <= 0 or (where and where[0] not in shard_dir):
        return
    with open(_file, "w") as fh:
        fh.write(" ".join([point, str(int(count) - 1), *where]) + "\n")
    os.kill(os.getpid(), signal.SIGKILL)


_hold = os.environ.get("BATCH_LLM_HOLD_FILE", "")


def _held(point: str) -> bool:
    try:
        with open(_hold) as fh:
            return fh.read().strip() == point
    except OSError:
        return False


def _hold_while_the_file_says(event: str, args: tuple) -> None:
    if event in CHECKPOINT_EVENTS:
        while _held(args[0]):
            time.sleep(0.2)


if _point:
    sys.addaudithook(_kill_at_the_nth_checkpoint)
if _hold:
    sys.addaudithook(_hold_while_the_file_says)
if _file:
    sys.addaudithook(_kill_while_the_file_counts)


# And one way to take the engine out of a run: ``BATCH_LLM_ECHO_ENGINE=1`` makes the shard runner of every process
# so started serve with an echo engine (each prompt answered ``echo <its token count>``), the tests' EchoEngine
# (tests/helpers.py) for processes a test cannot monkeypatch: the workers of a DAG run under a real scheduler, where
# what is measured is the pipeline's own work (bench/dag_day.py).
_RUNNER = "batch_llm.stages.infer.runner"


class _EchoEngine:
    def generate(self, reqs):
        from batch_llm.engines.base import GenResult

        for r in reqs:
            n = len(r.prompt_token_ids)
            yield GenResult(key=r.key, text=f"echo {n}", finish_reason="stop", prompt_tokens=n, completion_tokens=2)

    def close(self):
        pass


def _echo_start(*args, **kwargs):
    from batch_llm.engines.base import EngineInfo

    return _EchoEngine(), EngineInfo(kind="echo", version="0")


class _EchoRunner:
    """A meta-path finder that lets the runner module load as usual, then replaces its ``start_engine``."""

    def find_spec(self, name, path, target=None):
        if name != _RUNNER:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            module.start_engine = _echo_start

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("BATCH_LLM_ECHO_ENGINE"):
    sys.meta_path.insert(0, _EchoRunner())
