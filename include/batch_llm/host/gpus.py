"""GPU discovery: which GPUs this worker may hand out.

Standard library only: the run statistics, the recommendations, the GPU leases and the output identity ask it.
"""
from __future__ import annotations

import os
import shutil
import subprocess


def visible_gpus() -> list[str]:
    """GPU ids this worker may hand out: $BATCH_LLM_GPUS ("0,1"), else what nvidia-smi lists, else none."""
    env = os.environ.get("BATCH_LLM_GPUS")
    if env is not None:
        return [g.strip() for g in env.split(",") if g.strip()]
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]
