"""Storage helpers of the Airflow layer that read no credentials: ``split_conn`` (the ``conn@bucket`` form) and
failures that name the Airflow connection and the path (``storage_errors``, ``diagnose``).

Credentials are read by ``hooks.BatchLlmStorageHook``, the only code that reads storage connections. Only the
standard library is imported at module level: ``report_app`` (loaded with the plugin in every process) uses it.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from batch_llm.host import path_policy

if TYPE_CHECKING:
    from batch_llm.io.storage import Location


def split_conn(url: str) -> tuple[str, str | None]:
    """``s3://conn@bucket/key`` (Airflow's ObjectStoragePath form) -> (``s3://bucket/key``, ``conn``)."""
    if "://" in url:
        scheme, rest = url.split("://", 1)
        if "@" in rest.split("/", 1)[0]:
            conn, rest = rest.split("@", 1)
            return f"{scheme}://{rest}", conn
    return url, None



# ------------------------------------------------------------------------------------------ clear errors
@dataclass(frozen=True)
class StorageTarget:
    """A location a stage reads or writes, with the Airflow connection it is reached through."""

    conn_id: str | None
    location: Location
    must_exist: bool = False   # an input: the path itself must be there (an output only needs its bucket)


def _from_object_store(e: BaseException) -> bool:
    """s3fs turns botocore's ClientError into PermissionError / FileNotFoundError; the cause stays chained."""
    try:
        from botocore.exceptions import BotoCoreError, ClientError
    except ImportError:  # pragma: no cover - the amazon provider brings botocore
        return False
    seen = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, (ClientError, BotoCoreError)):
            return True
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return False


def diagnose(target: StorageTarget, error: BaseException | None = None) -> str | None:
    """Why ``target`` is unusable: credentials refused, bucket missing, input missing; None when it answers
    (or cannot be reached at all: outages are left to retries). Two small requests, only after a failure.
    ``error``: the failure being explained; a refusal quotes its text (a HEAD's is only "Forbidden")."""
    url = target.location.url
    if path_policy.resolve(url).kind == "local":
        return None
    try:
        path = target.location.path()
        bucket = path.path.split("/", 1)[0]
        path.fs.invalidate_cache(bucket)
        path.fs.info(bucket)
        if target.must_exist and not path.exists():
            return "not found"
    except PermissionError as e:
        said = error if isinstance(error, PermissionError) else e
        return f"access denied: wrong credentials or no permission ({said})"
    except FileNotFoundError:
        return f"bucket {bucket!r} does not exist"
    except Exception:  # noqa: BLE001 - unreachable endpoint and the like: not a configuration problem
        return None
    return None


def _who(conn_id: str | None) -> str:
    return f"storage connection {conn_id!r}" if conn_id else "storage (no connection: default credentials)"


@contextmanager
def storage_errors(targets: Iterable[StorageTarget] | Callable[[], Iterable[StorageTarget]]):
    """Re-raises a storage failure (wrong credentials, a missing bucket or path) as a ``RuntimeError`` that
    names the Airflow connection and the path::

        storage connection 'lake', path s3://lake/llm: bucket 'lake' does not exist

    s3fs's own errors name neither (``PermissionError: Forbidden``). The culprit is found by probing each
    target; when no probe fails (an object missing inside a healthy bucket) and the error came from the object
    store, every remote target is named. Connection errors (an outage) pass through unchanged: retries are
    the answer to those. ``targets`` may be a callable, read only when an error is raised."""
    try:
        yield
    except (PermissionError, FileNotFoundError) as e:
        found = list(targets() if callable(targets) else targets)
        remote = [t for t in found if path_policy.resolve(t.location.url).kind != "local"]
        blamed = [(t, reason) for t in remote if (reason := diagnose(t, e))]
        if not blamed:
            if not (remote and _from_object_store(e)):
                raise
            blamed = [(t, f"{type(e).__name__}: {e}") for t in remote]
        raise RuntimeError("; ".join(f"{_who(t.conn_id)}, path {t.location.url}: {reason}"
                                     for t, reason in blamed)) from e
