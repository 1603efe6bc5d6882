"""Fault injection for the resume tests, loaded only into processes whose PYTHONPATH names this folder.

The shard runner announces its checkpoints as audit events (``sys.audit(CHECKPOINT_EVENT, point)``), which
cost nothing when nobody listens. Here a listener reads ``BATCH_LLM_FAULT="after_commit:2"`` and kills its
own process with SIGKILL the 2nd time the shard reaches that checkpoint: a worker dying at the worst moment.
"""
import os
import signal
import sys

CHECKPOINT_EVENT = "batch_llm.shard.checkpoint"  # the name in batch_llm/infer.py
_spec = os.environ.get("BATCH_LLM_FAULT", "")
_point, _, _nth = _spec.partition(":")
_seen = 0


def _kill_at_the_nth_checkpoint(event: str, args: tuple) -> None:
    global _seen
    if event != CHECKPOINT_EVENT or args[0] != _point:
        return
    _seen += 1
    if _seen == int(_nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)


if _point:
    sys.addaudithook(_kill_at_the_nth_checkpoint)
