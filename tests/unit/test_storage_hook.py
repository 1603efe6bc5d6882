"""``BatchLlmStorageHook``: connections → fsspec options, ``conn@bucket``, and credentials that botocore refreshes
itself during a long sequence of writes against a real S3 server (SeaweedFS on loopback). No engine."""
from __future__ import annotations

import json
import os
import stat
import sys
import textwrap
import time
from pathlib import Path

import pytest
from batch_llm.io.storage import Location, atomic_writer
from batch_llm_airflow import get_provider_info as gpi
from batch_llm_airflow.hooks import BatchLlmStorageHook
from batch_llm_airflow.storage_bridge import split_conn


def _conn(monkeypatch, conn_id: str, **fields) -> None:
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps({"conn_type": "aws", **fields}))


# ------------------------------------------------------------------------------------------ options
def test_static_keys_endpoint_and_region_become_plain_options(monkeypatch):
    _conn(monkeypatch, "store_a", login="AKIA-A", password="secret-a",
          extra={"endpoint_url": "http://127.0.0.1:9", "region_name": "eu-west-3"})
    hook = BatchLlmStorageHook(storage_conn_id="store_a")
    want = {"key": "AKIA-A", "secret": "secret-a",
            "client_kwargs": {"endpoint_url": "http://127.0.0.1:9", "region_name": "eu-west-3"}}
    assert hook.storage_options() == want == hook.get_conn()
    loc = hook.location("s3://bucket/prefix")
    assert (loc.url, loc.options) == ("s3://bucket/prefix", want)
    assert "secret-a" not in repr(loc)  # Location hides its options


def test_a_session_token_of_the_connection_stays_static(monkeypatch):
    """A token stored in the connection has no source to refresh from: handed on as it is, no profile."""
    _conn(monkeypatch, "store_t", login="ASIA-T", password="secret-t", extra={"aws_session_token": "tok"})
    opts = BatchLlmStorageHook("store_t").storage_options()
    assert opts == {"key": "ASIA-T", "secret": "secret-t", "token": "tok", "client_kwargs": {}}


def test_conn_at_bucket_names_the_connection(monkeypatch):
    _conn(monkeypatch, "store_a", login="AKIA-A", password="secret-a")
    _conn(monkeypatch, "store_b", login="AKIA-B", password="secret-b", extra={"region_name": "us-west-2"})
    # the URL's connection wins over the hook's, as for ObjectStoragePath
    loc = BatchLlmStorageHook("store_a").location("s3://store_b@lake/llm/x.jsonl")
    assert loc.url == "s3://lake/llm/x.jsonl"
    assert (loc.options["key"], loc.options["client_kwargs"]) == ("AKIA-B", {"region_name": "us-west-2"})
    assert BatchLlmStorageHook(None).location("s3://store_a@lake/k").options["key"] == "AKIA-A"
    assert BatchLlmStorageHook("store_b").location("s3://lake/k").options["key"] == "AKIA-B"
    # no connection: botocore's default chain, nothing read here
    assert BatchLlmStorageHook(None).location("s3://lake/k") == Location("s3://lake/k", {})
    assert BatchLlmStorageHook(None).location("/data/llm").options == {}
    assert split_conn("s3://c@b/k/x@y") == ("s3://b/k/x@y", "c")
    assert split_conn("s3://b/k@x") == ("s3://b/k@x", None)
    assert split_conn("/local/a@b") == ("/local/a@b", None)


def test_a_connection_without_credentials_is_named(monkeypatch, tmp_path):
    # a profile that does not exist: the provider's session cannot load credentials
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    _conn(monkeypatch, "broken", extra={"profile_name": "absent"})
    with pytest.raises(RuntimeError, match="storage connection 'broken': cannot read credentials"):
        BatchLlmStorageHook("broken").storage_options()


def test_hook_follows_airflows_conventions_and_the_provider_lists_it():
    import airflow
    import jsonschema
    from airflow.sdk import BaseHook

    assert issubclass(BatchLlmStorageHook, BaseHook)
    assert (BatchLlmStorageHook.conn_name_attr, BatchLlmStorageHook.default_conn_name,
            BatchLlmStorageHook.conn_type) == ("storage_conn_id", "aws_default", "aws")
    assert BatchLlmStorageHook.hook_name
    assert BatchLlmStorageHook().storage_conn_id == "aws_default"
    info = gpi.get_provider_info()
    schema = json.loads((Path(airflow.__file__).parent / "provider_info.schema.json").read_text())
    jsonschema.validate(info, schema)
    assert info["hooks"] == [{"integration-name": "Batch LLM", "python-modules": ["batch_llm_airflow.hooks"]}]
    module = __import__(info["hooks"][0]["python-modules"][0], fromlist=["_"])
    assert module.BatchLlmStorageHook is BatchLlmStorageHook
    assert "connection-types" not in info  # conn_type "aws" is the amazon provider's


# ------------------------------------------------------------------------------------------ refreshing
def test_credential_process_prints_only_the_credentials_on_stdout(tmp_path):
    """botocore parses all of the process's stdout: Airflow's log lines (which go to stdout) must not be there,
    and a failure says why on stderr without the secret."""
    import subprocess

    from batch_llm_airflow.hooks import CREDENTIAL_PROCESS

    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"conn_id": "p", "conn": json.dumps(
        {"conn_type": "aws", "login": "AKIA-P", "password": "secret-p"})}))
    done = subprocess.run([sys.executable, "-c", CREDENTIAL_PROCESS, str(spec)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"Version": 1, "AccessKeyId": "AKIA-P", "SecretAccessKey": "secret-p"}
    assert "credentials retrieved" in done.stderr  # the provider's log line, moved off stdout
    spec.write_text(json.dumps({"conn_id": "p", "conn": json.dumps(
        {"conn_type": "aws", "password": "secret-p", "extra": {"profile_name": "absent"}})}))
    done = subprocess.run([sys.executable, "-c", CREDENTIAL_PROCESS, str(spec)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "AWS_CONFIG_FILE": str(tmp_path / "none")})
    assert done.returncode == 1 and done.stdout == "" and "batch-llm credential_process" in done.stderr
    assert "secret-p" not in done.stderr


KEYS = 12        # identities the server accepts; the source hands out key-1, key-2, ... in turn
LEAD = 3.0       # seconds until botocore's advisory refresh (it refreshes 15 min before the expiry)

SOURCE = textwrap.dedent("""\
    # a short-lived credential source (an STS stand-in): each call hands out the next identity
    import datetime, json, sys
    from pathlib import Path
    log = Path(sys.argv[1])
    n = len(log.read_text().splitlines()) + 1 if log.exists() else 1
    with log.open("a") as f:
        f.write(f"key-{n}\\n")
    expiry = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(minutes=15, seconds=float(sys.argv[2]))
    print(json.dumps({"Version": 1, "AccessKeyId": f"key-{n}", "SecretAccessKey": f"secret-{n}",
                      "Expiration": expiry.isoformat()}))
""")


@pytest.fixture(scope="module")
def rotating_s3(tmp_path_factory):
    """The real SeaweedFS server (tests/s3_server.py) accepting identities key-0 .. key-N."""
    from s3_server import S3Server

    server = S3Server(tmp_path_factory.mktemp("s3-rotating"), bucket="batch-llm-rotating", key="key-0",
                      secret="secret-0")
    (server.root / "s3.json").write_text(json.dumps({"identities": [{
        "name": f"id-{i}", "credentials": [{"accessKey": f"key-{i}", "secretKey": f"secret-{i}"}],
        "actions": ["Admin", "Read", "Write", "List"]} for i in range(KEYS)]}))
    with server:
        yield server


def test_short_lived_credentials_are_refreshed_by_botocore_during_a_long_write(rotating_s3, monkeypatch, tmp_path):
    """A connection whose credentials expire (here a credential_process source behind ``profile_name``, as an
    assumed role's would): the options carry no key, botocore refreshes them through the hook's generated
    profile, every write succeeds and the later ones are signed with the fresh keys."""
    issued = tmp_path / "issued.txt"
    (tmp_path / "source.py").write_text(SOURCE)
    (tmp_path / "aws-config").write_text(
        f"[profile src]\ncredential_process = {sys.executable} {tmp_path / 'source.py'} {issued} {LEAD}\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "aws-config"))
    _conn(monkeypatch, "rotating", extra={"profile_name": "src", "endpoint_url": rotating_s3.endpoint,
                                          "region_name": rotating_s3.region})

    opts = BatchLlmStorageHook("rotating").storage_options()
    assert set(opts) == {"profile", "session_vars", "client_kwargs"}   # no frozen key, secret or token
    assert issued.read_text().split() == ["key-1"]                     # the hook's own check of the connection
    config = opts["session_vars"]["config_file"][2]
    folder = os.path.dirname(config)
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    assert all(stat.S_IMODE(os.stat(os.path.join(folder, f)).st_mode) == 0o600 for f in os.listdir(folder))
    assert "secret" not in Path(config).read_text()                    # the profile names a process, no key
    assert BatchLlmStorageHook("rotating").storage_options() == opts   # one profile per connection and process

    # as the shard worker gets them: JSON over its pipe
    root = Location("s3://batch-llm-rotating/refresh", json.loads(json.dumps(opts)))
    signed_with: list[str] = []

    def record(request, **_):
        auth = request.headers.get("Authorization", b"")
        auth = auth.decode() if isinstance(auth, bytes) else auth
        signed_with.append(auth.split("Credential=", 1)[1].split("/", 1)[0])

    fs = root.path().fs
    fs.ls("batch-llm-rotating")    # the first request: the initial credential load; s3fs's client is now kept
    hooked: list = []              # every client the writes went through: once under load none was recorded,

    def hook_client() -> None:     # as if s3fs had swapped its client (it may, on a key that expired in flight)
        if not any(c is fs.s3 for c in hooked):
            fs.s3.meta.events.register("before-send.s3", record)
            hooked.append(fs.s3)

    written, deadline = 0, time.monotonic() + 120
    while len(issued.read_text().split()) < 4 and time.monotonic() < deadline:  # the load and two refreshes
        hook_client()
        with atomic_writer(root.child(f"chunk-{written:05d}.jsonl").path()) as w:
            w.write(b'{"row": %d}\n' % written)
        written += 1
        time.sleep(0.05)
    handed_out = issued.read_text().split()
    refreshes = len(handed_out) - 2   # less the hook's check and the initial load
    assert refreshes >= 2, f"{refreshes} refreshes in {written} writes: botocore did not refresh"
    assert handed_out[:4] == ["key-1", "key-2", "key-3", "key-4"]
    # the writes were signed with the keys handed out after the hook's check, each refreshed one in turn (the
    # first write may already need a refresh: the load happened during the listing before it)
    used = list(dict.fromkeys(signed_with))
    assert len(used) >= 2 and used[0] in ("key-2", "key-3"), used
    assert used == handed_out[handed_out.index(used[0]):][:len(used)], (used, handed_out)
    # every write landed
    names = sorted(p.name for p in root.path().iterdir())
    assert names == [f"chunk-{i:05d}.jsonl" for i in range(written)]
    print(f"{written} writes, {refreshes} refreshes, keys on the wire: {used}")
