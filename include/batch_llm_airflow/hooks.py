"""``BatchLlmStorageHook``: Airflow connections → fsspec options, the only code that reads storage credentials.

The stage library (and the engine worker, a process without Airflow) works on plain ``Location`` objects (URL +
fsspec options, which travel in memory and as JSON over the worker's pipe and are never logged), so every
operator and the report app resolve connections here::

    hook = BatchLlmStorageHook(storage_conn_id="lake")
    hook.storage_options()                      # {"key": ..., "secret": ..., "client_kwargs": {...}}
    hook.location("s3://bucket/prefix")          # a Location reached through "lake"
    BatchLlmStorageHook(None).location("s3://lake@bucket/prefix")   # the path names its connection

Connections are the amazon provider's ``aws`` ones (login/password, ``role_arn``, ``profile_name``, endpoint
and region extras): this hook reads them through ``S3Hook`` and defines no connection type of its own. The amazon
provider is the ``s3`` extra (``pip install "batch-llm[s3]"``), imported only when a connection's credentials are
read: a location that is not ``s3://`` never reads one, so DAGs, local paths and a deployment without the extra
need no amazon provider, and a connection used without it fails naming the extra.

Static keys become ``key``/``secret`` options as they are. Credentials that botocore can refresh (an assumed
role, web identity, a ``credential_process`` or instance profile behind the connection) would expire during a
long shard if frozen into options, so they become a generated AWS config profile instead: its
``credential_process`` runs this module's ``_main`` on a spec file, which prints fresh credentials from the
connection with their expiry, and botocore (in every process that opens the location, the worker included)
wraps that source in refreshable credentials and runs it again before they expire. The profile's files live in
a private temporary folder (0700, files 0600) removed when the process that made them exits.
"""
from __future__ import annotations

import atexit
import hashlib
import json
import os
import re
import shlex
import shutil
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from airflow.sdk import BaseHook
from batch_llm.io.storage import Location

from batch_llm_airflow.storage_bridge import split_conn

__all__ = ["BatchLlmStorageHook"]


class BatchLlmStorageHook(BaseHook):
    """Storage credentials of one Airflow ``aws`` connection, as fsspec/s3fs options.

    :param storage_conn_id: the connection; ``None``: no connection, botocore's default credential chain
        (environment, instance profile), resolved by botocore itself wherever the location is opened.

    ``conn_type`` is the amazon provider's ``aws``: a pipeline's ``conn_id`` is an ordinary AWS connection
    (the same form, the same role/profile options), so this hook registers no connection type of its own
    (Airflow keeps one hook per connection type; a second ``aws`` would be refused as a duplicate).
    """

    conn_name_attr = "storage_conn_id"
    default_conn_name = "aws_default"
    conn_type = "aws"
    hook_name = "Batch LLM storage (AWS connection)"

    def __init__(self, storage_conn_id: str | None = default_conn_name, **kwargs: Any):
        super().__init__(**kwargs)
        self.storage_conn_id = storage_conn_id

    def get_conn(self) -> dict:
        """BaseHook's accessor: the fsspec options (a dict: s3fs opens its own clients)."""
        return self.storage_options()

    def location(self, url: str) -> Location:
        """A ``Location`` for ``url``; a connection named in the URL (``s3://conn@bucket/key``) wins over this
        hook's, as it does for Airflow's ObjectStoragePath."""
        url, named = split_conn(url)
        if not _is_s3(url):  # an aws connection serves s3:// only: nothing to read (and no amazon provider needed)
            return Location(url, {})
        if named and named != self.storage_conn_id:
            return BatchLlmStorageHook(named).location(url)
        return Location(url, self.storage_options())

    def storage_options(self) -> dict:
        """fsspec options for the connection (``{}`` without one). Static keys as ``key``/``secret``;
        refreshable credentials as a generated profile that botocore refreshes itself (module docstring)."""
        conn_id = self.storage_conn_id
        if not conn_id:
            return {}
        S3Hook, RefreshableCredentials = _amazon(conn_id)
        s3 = S3Hook(aws_conn_id=conn_id)
        try:
            creds = s3.get_session().get_credentials()
            if creds is None:
                raise RuntimeError("the connection yields no credentials")
            frozen = creds.get_frozen_credentials()
        except Exception as e:  # noqa: BLE001 - re-raised with the connection named
            raise RuntimeError(f"storage connection {conn_id!r}: cannot read credentials: {e}") from None
        client_kwargs = {}
        if endpoint := s3.conn_config.get_service_endpoint_url(service_name="s3"):
            client_kwargs["endpoint_url"] = endpoint
        if region := s3.conn_config.region_name:
            client_kwargs["region_name"] = region
        if isinstance(creds, RefreshableCredentials):
            conn = s3.get_connection(conn_id)
            return {**_refreshing_profile(conn_id, conn.as_json()), "client_kwargs": client_kwargs}
        from airflow.sdk.log import mask_secret

        # registered with the task's secrets masker, as S3Hook.get_credentials does: redacted if ever printed
        mask_secret(frozen.secret_key)
        opts = {"key": frozen.access_key, "secret": frozen.secret_key, "client_kwargs": client_kwargs}
        if frozen.token:
            mask_secret(frozen.token)
            opts["token"] = frozen.token
        return opts


S3_EXTRA_HINT = 'the amazon provider is not installed: pip install "batch-llm[s3]" (apache-airflow-providers-amazon[s3fs])'


def _is_s3(url: str) -> bool:
    return "://" in url and url.split("://", 1)[0].lower() in ("s3", "s3a")


def _amazon(conn_id: str) -> tuple[Any, Any]:
    """``(S3Hook, RefreshableCredentials)``: the amazon provider (the ``s3`` extra), imported only here, when a
    connection's credentials are read."""
    try:
        from airflow.providers.amazon.aws.hooks.s3 import S3Hook
        from botocore.credentials import RefreshableCredentials
    except ImportError as e:
        raise ImportError(f"storage connection {conn_id!r}: {S3_EXTRA_HINT} ({e})") from e
    return S3Hook, RefreshableCredentials


# ------------------------------------------------------------------------------------------ refreshable
_profiles: dict[str, dict] = {}
_profiles_lock = threading.Lock()
_private_dir: str | None = None


def _private() -> str:
    """One 0700 folder per process for the generated profiles, removed at exit (mkdtemp makes it 0700)."""
    global _private_dir
    if _private_dir is None:
        _private_dir = tempfile.mkdtemp(prefix="batch-llm-aws-")
        atexit.register(shutil.rmtree, _private_dir, True)
    return _private_dir


def _write_private(path: Path, text: str) -> None:
    """Created 0600 from the start (no window in which another user could read it)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _refreshing_profile(conn_id: str, conn_json: str) -> dict:
    """The s3fs options that make botocore read credentials from a generated profile whose
    ``credential_process`` prints them fresh from ``conn_json``. One profile per connection content and process:
    a task opens many locations through one connection."""
    digest = hashlib.sha256(f"{conn_id}\0{conn_json}".encode()).hexdigest()[:16]
    with _profiles_lock:
        if digest in _profiles:
            return _profiles[digest]
        folder = Path(_private())
        name = f"batch-llm-{re.sub(r'[^A-Za-z0-9_-]', '_', conn_id)}-{digest[:8]}"
        spec, config = folder / f"{digest}.json", folder / f"{digest}.config"
        _write_private(spec, json.dumps({"conn_id": conn_id, "conn": conn_json}))
        command = " ".join(shlex.quote(a) for a in (sys.executable, "-c", CREDENTIAL_PROCESS, str(spec)))
        _write_private(config, f"[profile {name}]\ncredential_process = {command}\n")
        # JSON-safe (the worker gets its options over a pipe): aiobotocore's AioSession(profile=, session_vars=)
        # are s3fs's pass-through kwargs. session_vars entries are (config name, env var, default, converter):
        # this session reads only these files, never ~/.aws or AWS_* variables, and an explicit profile also
        # turns botocore's environment-variable credentials off.
        opts = {"profile": name, "session_vars": {
            "config_file": [None, None, str(config), None],
            "credentials_file": [None, None, str(folder / f"{digest}.none"), None]}}
        _profiles[digest] = opts
        return opts


def credentials_from_spec(spec_path: str) -> dict:
    """What the ``credential_process`` prints (botocore's Version 1 format): credentials of the connection in
    ``spec_path`` through the amazon provider's session factory (assumed roles, profiles, web identity), with
    ``Expiration`` when botocore may refresh them. Reads no metadata database or Execution API: the worker
    cannot reach them, the connection as the task read it is in the spec."""
    from airflow.providers.amazon.aws.hooks.base_aws import SessionFactory
    from airflow.providers.amazon.aws.utils.connection_wrapper import AwsConnectionWrapper
    from airflow.sdk import Connection

    spec = json.loads(Path(spec_path).read_text())
    conn = Connection.from_json(spec["conn"], conn_id=spec["conn_id"])
    creds = SessionFactory(conn=AwsConnectionWrapper(conn=conn)).create_session().get_credentials()
    if creds is None:
        raise RuntimeError(f"connection {spec['conn_id']!r} yields no credentials")
    frozen = creds.get_frozen_credentials()  # refreshes first where due
    out = {"Version": 1, "AccessKeyId": frozen.access_key, "SecretAccessKey": frozen.secret_key}
    if frozen.token:
        out["SessionToken"] = frozen.token
    if expiry := getattr(creds, "_expiry_time", None):  # RefreshableCredentials keeps it only privately
        out["Expiration"] = expiry.isoformat()
    return out


# The credential_process. botocore parses all of its stdout as the credentials, and Airflow's logging writes to
# stdout: file descriptor 1 is pointed at stderr before anything is imported, the JSON goes to the saved one.
CREDENTIAL_PROCESS = ("import os, sys; out = os.dup(1); os.dup2(2, 1); "
            "from batch_llm_airflow.hooks import _main; sys.exit(_main(out, sys.argv[1]))")


def _main(out_fd: int, spec_path: str) -> int:
    try:
        creds = credentials_from_spec(spec_path)
    except Exception as e:  # noqa: BLE001 - botocore shows stderr in its CredentialRetrievalError
        print(f"batch-llm credential_process: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    os.write(out_fd, json.dumps(creds).encode())
    return 0
