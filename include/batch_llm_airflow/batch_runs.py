"""The OpenAI Batch API's side of a DAG run (``batch_llm.batch_api`` does the work): where files and batches live,
the batch a run serves, and the watch that stops a batch's shards when it is cancelled or expires.

The store: ``$BATCH_LLM_OPENAI_STORE`` or ``[batch_llm] openai_store`` (a local folder or an object-store URL,
``s3://conn@bucket/prefix`` naming its Airflow connection), by default ``<AIRFLOW_HOME>/openai_batch``. The API
server and every worker that runs a batch's tasks must reach the same one: on more than one host, object storage.
"""
from __future__ import annotations

import os
import threading
from collections.abc import Callable

from batch_llm.batch_api.runs import PARAM, batch_of_run, run_overrides
from batch_llm.batch_api.stop import StopReason, stop_reason
from batch_llm.batch_api.store import BatchStore

from batch_llm_airflow.storage_bridge import split_conn

STORE_ENV = "BATCH_LLM_OPENAI_STORE"
#: How often a running shard of a batch looks for a cancel or the end of its completion window.
STOP_POLL_SECONDS = 2.0


def store_url() -> str:
    url = os.environ.get(STORE_ENV)
    if not url:
        from airflow.configuration import conf

        url = conf.get("batch_llm", "openai_store", fallback="") or os.path.join(
            conf.get("core", "airflow_home", fallback=os.environ.get("AIRFLOW_HOME", "~/airflow")), "openai_batch")
    return os.path.expanduser(url)


def batch_store() -> tuple[BatchStore, str | None]:
    """The deployment's store and the Airflow connection it is reached through (None: none)."""
    from batch_llm_airflow.hooks import BatchLlmStorageHook

    url, conn = split_conn(store_url())
    return BatchStore(BatchLlmStorageHook(conn).location(url)), conn


def batch_id_of(params: dict) -> str | None:
    value = params.get(PARAM)
    return value if isinstance(value, str) and value else None


def batch_overrides(params: dict, dag_id: str) -> tuple[dict, dict | None]:
    """(config overrides, batch record) of a run that serves a batch; ({}, None) for any other run. ValueError
    when the Param names no batch of this pipeline."""
    bid = batch_id_of(params)
    if bid is None:
        return {}, None
    store, conn = batch_store()
    record = batch_of_run(store, bid, dag_id)
    return {**run_overrides(store, record), "input.conn_id": conn}, record


def run_watched(run_shard: Callable[[], list], stop: Callable[[], None], batch: dict | None) -> list | StopReason:
    """``run_shard()`` (a shard task's worker run: its manifests); for a batch's run, watched: the batch's
    ``StopReason`` instead when it was cancelled or expired before or while the shard ran (the worker then ended
    by ``stop``, the GPU lease freed)."""
    if batch is None:
        return run_shard()
    watch = StopWatch(batch["id"], stop)
    if (reason := watch.check()) is not None:
        return reason
    watch.start()
    try:
        return run_shard()
    except Exception:
        if watch.reason is not None:  # the worker was ended by the watch
            return watch.reason
        raise
    finally:
        watch.close()


class StopWatch:
    """Calls ``stop`` once, from a thread of its own, when the batch ``batch_id`` must stop (``stop_reason``);
    ``reason`` then says why. ``close()`` ends the watch."""

    def __init__(self, batch_id: str, stop: Callable[[], None], poll: float = STOP_POLL_SECONDS):
        self.batch_id, self._stop, self.poll = batch_id, stop, poll
        self.reason: StopReason | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"batch-stop-{batch_id}", daemon=True)

    def check(self) -> StopReason | None:
        self.reason = self.reason or stop_reason(batch_store()[0], self.batch_id)
        return self.reason

    def start(self) -> "StopWatch":
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._done.wait(self.poll):
            try:
                if self.check() is not None:
                    self._stop()
                    return
            except Exception:  # noqa: BLE001 - a store hiccup: the next poll asks again
                continue

    def close(self) -> None:
        self._done.set()
