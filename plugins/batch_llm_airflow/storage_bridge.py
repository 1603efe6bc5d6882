"""Airflow connections → fsspec options: the only place that reads storage credentials.

The stage library (and the engine worker, which has no Airflow) works on plain ``Location`` objects, so the
connection is resolved once here. Options may hold secrets: they travel in memory and over a pipe, and are
never logged.
"""
from __future__ import annotations

from batch_llm.storage import Location


def storage_options(conn_id: str | None) -> dict:
    if not conn_id:
        return {}
    from airflow.providers.amazon.aws.hooks.s3 import S3Hook

    hook = S3Hook(aws_conn_id=conn_id)
    try:
        creds = hook.get_credentials()
    except Exception as e:  # noqa: BLE001 - re-raised with the connection named
        raise RuntimeError(f"storage connection {conn_id!r}: cannot read credentials: {e}") from None
    client_kwargs = {}
    if endpoint := hook.conn_config.get_service_endpoint_url(service_name="s3"):
        client_kwargs["endpoint_url"] = endpoint
    if region := hook.conn_config.region_name:
        client_kwargs["region_name"] = region
    opts = {"key": creds.access_key, "secret": creds.secret_key, "client_kwargs": client_kwargs}
    if creds.token:
        opts["token"] = creds.token
    return opts


def location(url: str, conn_id: str | None) -> Location:
    """A Location for ``url``; ``s3://conn@bucket/key`` (Airflow's ObjectStoragePath form) works too."""
    if "://" in url and "@" in url.split("://", 1)[1].split("/", 1)[0]:
        scheme, rest = url.split("://", 1)
        conn_id, rest = rest.split("@", 1)
        url = f"{scheme}://{rest}"
    return Location(url, storage_options(conn_id))
