"""The storage options of a ``Location`` (fsspec/s3fs form: what ``BatchLlmStorageHook`` derives from an Airflow
connection) in the forms the table libraries take: delta-rs's ``AWS_*`` options and pyiceberg's ``s3.*``
properties.

Credentials that botocore refreshes (the hook's generated profile) are read once, fresh, when a sink opens the
table: a publish's commit takes seconds to minutes, well within their lifetime.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class S3Access:
    key: str | None = None
    secret: str | None = None
    token: str | None = None
    endpoint: str | None = None
    region: str | None = None

    @classmethod
    def of(cls, options: dict[str, Any] | None) -> "S3Access":
        opts = dict(options or {})
        client = opts.get("client_kwargs") or {}
        key, secret, token = opts.get("key"), opts.get("secret"), opts.get("token")
        if key is None and opts.get("profile"):
            key, secret, token = _profile_credentials(opts["profile"], opts.get("session_vars") or {})
        return cls(key=key, secret=secret, token=token, endpoint=client.get("endpoint_url") or opts.get("endpoint_url"),
                   region=client.get("region_name") or opts.get("region_name"))

    def delta_options(self) -> dict[str, str]:
        """delta-rs (object_store) options. Without keys, its own default chain (environment, instance role)."""
        out = {"AWS_ACCESS_KEY_ID": self.key, "AWS_SECRET_ACCESS_KEY": self.secret, "AWS_SESSION_TOKEN": self.token,
               "AWS_ENDPOINT_URL": self.endpoint, "AWS_REGION": self.region or "us-east-1"}
        if self.endpoint and self.endpoint.startswith("http://"):
            out["AWS_ALLOW_HTTP"] = "true"
        return {k: v for k, v in out.items() if v}

    def iceberg_properties(self) -> dict[str, str]:
        """pyiceberg FileIO properties."""
        out = {"s3.access-key-id": self.key, "s3.secret-access-key": self.secret, "s3.session-token": self.token,
               "s3.endpoint": self.endpoint, "s3.region": self.region}
        return {k: v for k, v in out.items() if v}


def _profile_credentials(profile: str, session_vars: dict) -> tuple[str | None, str | None, str | None]:
    import botocore.session

    session = botocore.session.Session(session_vars={k: tuple(v) for k, v in session_vars.items()}, profile=profile)
    creds = session.get_credentials()
    if creds is None:
        raise RuntimeError(f"storage profile {profile!r} yields no credentials")
    frozen = creds.get_frozen_credentials()
    return frozen.access_key, frozen.secret_key, frozen.token


def is_s3(url: str) -> bool:
    return url.split("://", 1)[0].lower() in ("s3", "s3a") if "://" in url else False
