"""The Batch object of a batch record and its run, field for field as OpenAI returns it.

A batch is one run of its pipeline's DAG; its status follows the run:

=============  ==========================================================================================
validating     the run has not checked the input file yet (queued, or its plan task runs)
failed         the input file failed its check (``errors``), or the run failed
in_progress    checked; shards run. ``request_counts`` from the plan's refusals and the shards' commits
finalizing     the content filter, evaluate or publish task has started
completed      the run succeeded: ``output_file_id`` / ``error_file_id`` name the published lines
cancelling     a cancel was asked and the run is still going (its shards stop, the rest publishes)
cancelled      the run finished after a cancel: what was answered before it is published
expired        the run finished after its completion window passed: likewise
=============  ==========================================================================================
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from batch_llm.batch_api.stop import STATUS_OF, expires_at
from batch_llm.batch_api.store import BatchStore
from batch_llm.io.storage import iter_jsonl, list_files
from batch_llm.layout import RunLayout, read_manifest_at
from batch_llm.manifests import ShardManifest

FINALIZING_TASKS = ("content_filter", "evaluate", "publish")


@dataclass(frozen=True)
class TaskView:
    state: str | None
    start: int | None = None
    end: int | None = None


@dataclass(frozen=True)
class RunView:
    """What the status needs of a DAG run: its state and end, and its tasks' states by task id (without the
    task group's prefix; a mapped task once per map index)."""

    state: str | None
    end: int | None = None
    tasks: dict[str, list[TaskView]] = field(default_factory=dict)

    def started(self, task: str) -> list[TaskView]:
        return [t for t in self.tasks.get(task, []) if t.start is not None]


def progress(layout: RunLayout) -> tuple[int, int]:
    """(completed, failed) requests so far: the plan's refused lines, then each shard's committed rows (its
    manifest once it has one, else its committed chunks)."""
    try:
        plan = read_manifest_at(layout, "plan")
    except FileNotFoundError:
        return 0, 0
    completed, failed = 0, plan.invalid + plan.duplicates
    for spec in plan.shards:
        shard_dir = layout.shard_dir(spec.index)
        if (m := ShardManifest.read_if_done(shard_dir.path())) is not None:
            completed, failed = completed + m.metrics.ok, failed + m.metrics.errors
            continue
        seen: set[str] = set()
        for f in list_files(shard_dir.child("chunks").path(), ".jsonl"):
            for r in iter_jsonl(f):
                if r["id"] in seen:
                    continue
                seen.add(r["id"])
                if r.get("error"):
                    failed += 1
                else:
                    completed += 1
    return completed, failed


def _status(record: dict, run: RunView | None, notes: dict, t: dict, checked: bool,
            now: float | None) -> tuple[str, dict | None]:
    """(status, errors) of the batch; fills the failed and terminal times into ``t``."""
    validation, stopped, cancel = notes["validation"], notes["stopped"], notes["cancel"]
    run_end = run.end if run is not None else None

    def errors(code: str, message: str) -> dict:
        return {"object": "list", "data": [{"code": code, "message": message, "param": None, "line": None}]}

    if validation is not None and validation["errors"]:
        t["failed_at"] = int(validation["checked_at"])
        return "failed", {"object": "list", "data": validation["errors"]}
    if run is None:
        t["failed_at"] = int(record["created_at"])
        return "failed", errors("run_not_found", "The batch's run is gone (its DAG run was deleted).")
    if run.state == "failed":
        t["failed_at"] = run_end or int(time.time() if now is None else now)
        return "failed", errors("run_failed", f"The batch's run {record['pipeline']}/{record['id']} failed; its task "
                                              "logs say why.")
    if run.state == "success":
        status = STATUS_OF[stopped["code"]] if stopped else "completed"
        t[f"{status}_at"] = run_end
        return status, None
    if cancel is not None:
        return "cancelling", None
    if not checked:
        return "validating", None
    return ("finalizing" if t["finalizing_at"] is not None else "in_progress"), None


def batch_object(record: dict, run: RunView | None, store: BatchStore, layout: RunLayout | None,
                 now: float | None = None) -> dict:
    """The Batch object (OpenAI's fields, in its order) of ``record`` and its run's ``run`` (None: no run)."""
    bid = record["id"]
    notes = {name: store.note(bid, name) for name in ("cancel", "validation", "stopped", "files")}
    validation, files = notes["validation"], notes["files"]
    t: dict[str, int | None] = dict.fromkeys(("in_progress_at", "finalizing_at", "completed_at", "failed_at",
                                              "expired_at", "cancelling_at", "cancelled_at"))
    checked = validation is not None and not validation["errors"]
    if notes["cancel"] is not None:
        t["cancelling_at"] = int(notes["cancel"]["cancelling_at"])
    if checked and validation is not None:
        t["in_progress_at"] = int(validation["checked_at"])
    if run is not None and (final := [s.start for k in FINALIZING_TASKS for s in run.started(k) if s.start]):
        t["finalizing_at"] = min(final)
    status, errors = _status(record, run, notes, t, checked, now)
    if files is not None:
        done, failed = files["completed"], files["failed"]
    elif layout is not None and checked:
        done, failed = progress(layout)
    else:
        done = failed = 0
    return {"id": bid, "object": "batch", "endpoint": record["endpoint"], "model": record["model"],
            "errors": errors, "input_file_id": record["input_file_id"],
            "completion_window": record["completion_window"], "status": status,
            "output_file_id": files["output_file_id"] if files else None,
            "error_file_id": files["error_file_id"] if files else None,
            "created_at": record["created_at"], "in_progress_at": t["in_progress_at"],
            "expires_at": expires_at(record), "finalizing_at": t["finalizing_at"],
            "completed_at": t["completed_at"], "failed_at": t["failed_at"], "expired_at": t["expired_at"],
            "cancelling_at": t["cancelling_at"], "cancelled_at": t["cancelled_at"],
            "request_counts": {"total": validation["lines"] if validation else 0, "completed": done,
                               "failed": failed},
            "usage": files["usage"] if files else None, "metadata": record.get("metadata")}
