"""engine.compile_cache: the sync of vLLM's compilation cache, against a local folder used as a store
(``file://``) and the real S3 server (SeaweedFS on loopback). No vLLM starts here: on the CPU the project runs
vLLM in eager mode, which compiles nothing; the engine start is a fake engine that writes files where vLLM's
cache root points, as a compiling start does."""
from __future__ import annotations

import io
import json
import os
import tarfile
import threading
from pathlib import Path

import pytest
from batch_llm.cache import compile as compile_cache
from batch_llm.config import EngineConfig
from batch_llm.engines import start as engine_start
from batch_llm.engines.base import EngineInfo
from batch_llm.io.storage import Location, write_bytes_atomic
from helpers import demo_config


@pytest.fixture(autouse=True)
def _restore_env(monkeypatch):
    """prepare() sets these for the process (as the worker needs); the test's changes are undone after it."""
    for k in ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "BATCH_LLM_COMPILE_CACHE_LOCAL"):
        monkeypatch.setenv(k, "unset-by-test")
        monkeypatch.delenv(k)


@pytest.fixture
def model_dir(tmp_path) -> str:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 64}))
    return str(d)


@pytest.fixture(params=["file", "s3"])
def store(request, tmp_path) -> Location:
    """The object-storage prefix: a local folder as a store, or a bucket prefix on the real S3 server."""
    if request.param == "file":
        return Location(f"file://{tmp_path / 'store'}")
    s3 = request.getfixturevalue("s3")
    return Location(f"s3://{s3.bucket}/compile-cache/{request.node.name}", s3.storage_options())


def _worker(monkeypatch, tmp_path: Path, name: str) -> None:
    """A fresh worker: its own local folder for unpacked caches."""
    monkeypatch.setenv("BATCH_LLM_COMPILE_CACHE_LOCAL", str(tmp_path / f"worker-{name}"))


def _compile(files: dict[str, bytes]) -> None:
    """What a compiling engine start leaves: files under vLLM's cache root (the variable prepare() set)."""
    root = Path(os.environ["VLLM_CACHE_ROOT"])
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)


def _tree(root: str | Path) -> dict[str, bytes]:
    root = Path(root)
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


FILES = {"torch_compile_cache/abc123/rank_0_0/backbone/vllm_compile_cache.py": b"{'graph': 1}\n",
         "torch_compile_cache/abc123/inductor_cache/fx/xy.py": b"kernel" * 1000,
         "triton/K1/kernel.cubin": os.urandom(4096)}


def test_local_folder_is_vllm_cache_root(tmp_path):
    root = tmp_path / "cc"
    said: list[str] = []
    cc = compile_cache.prepare(str(root), "m", EngineConfig(), said.append)
    assert os.environ["VLLM_CACHE_ROOT"] == str(root)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"].startswith(str(root))
    assert os.environ["TRITON_CACHE_DIR"].startswith(str(root))
    assert cc.archive is None and not cc.hit and cc.files_before == 0
    _compile(FILES)
    compile_cache.publish(cc, said.append)
    assert cc.files_after == 3 and not cc.uploaded  # a local folder is the cache itself: nothing to upload
    again = compile_cache.prepare(str(root), "m", EngineConfig(), said.append)
    assert again.hit and again.files_before == 3
    assert compile_cache.prepare(None, "m", EngineConfig(), said.append) is None


def test_archive_up_then_a_second_worker_gets_the_files(store, model_dir, tmp_path, monkeypatch):
    said: list[str] = []
    _worker(monkeypatch, tmp_path, "a")
    a = compile_cache.prepare(store.url, model_dir, EngineConfig(), said.append, options=store.options)
    assert not a.hit and not a.downloaded and a.files_before == 0
    assert Path(os.environ["VLLM_CACHE_ROOT"]) == Path(a.local_dir)
    _compile(FILES)
    compile_cache.publish(a, said.append)
    assert a.uploaded and a.files_after == 3 and not a.warnings
    assert a.archive.endswith(compile_cache.ARCHIVE_SUFFIX) and a.archive.startswith(store.url)
    assert Location(a.archive, store.options).path().exists()
    assert "options" not in a.record() and json.dumps(a.record())  # no credentials in the manifest

    _worker(monkeypatch, tmp_path, "b")
    b = compile_cache.prepare(store.url, model_dir, EngineConfig(), said.append, options=store.options)
    assert b.downloaded and b.hit and b.files_before == 3 and b.local_dir != a.local_dir
    assert _tree(b.local_dir) == FILES
    compile_cache.publish(b, said.append)
    assert not b.uploaded  # nothing new: the archive is not written again

    # other graph-changing settings: another archive, so worker c starts cold
    _worker(monkeypatch, tmp_path, "c")
    c = compile_cache.prepare(store.url, model_dir, EngineConfig(max_num_seqs=8), said.append, options=store.options)
    assert not c.hit and c.archive != a.archive


def test_new_files_upload_a_superset(store, model_dir, tmp_path, monkeypatch):
    said: list[str] = []
    _worker(monkeypatch, tmp_path, "a")
    a = compile_cache.prepare(store.url, model_dir, EngineConfig(), said.append, options=store.options)
    _compile(FILES)
    compile_cache.publish(a, said.append)
    _worker(monkeypatch, tmp_path, "b")
    b = compile_cache.prepare(store.url, model_dir, EngineConfig(), said.append, options=store.options)
    _compile({"torch_compile_cache/def456/rank_0_0/model": b"another shape"})
    compile_cache.publish(b, said.append)
    assert b.uploaded and b.files_after == 4
    _worker(monkeypatch, tmp_path, "c")
    c = compile_cache.prepare(store.url, model_dir, EngineConfig(), said.append, options=store.options)
    assert _tree(c.local_dir) == {**FILES, "torch_compile_cache/def456/rank_0_0/model": b"another shape"}


def _archive_bytes(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for rel, data in files.items():
            info = tarfile.TarInfo(rel)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.mark.parametrize("damage", ["garbage", "truncated", "escaping"])
def test_a_corrupt_or_partial_archive_is_a_miss_with_a_warning(store, model_dir, tmp_path, monkeypatch, damage):
    key = compile_cache.cache_key(model_dir, EngineConfig())
    good = _archive_bytes(FILES)
    data = {"garbage": b"not a tar archive at all" * 50, "truncated": good[: len(good) // 2],
            "escaping": _archive_bytes({"../../outside.txt": b"x"})}[damage]
    write_bytes_atomic(Location(store.url, store.options).child(key + compile_cache.ARCHIVE_SUFFIX).path(), data)
    _worker(monkeypatch, tmp_path, "a")
    said: list[str] = []
    cc = compile_cache.prepare(store.url, model_dir, EngineConfig(), said.append, options=store.options)
    assert not cc.hit and not cc.downloaded and cc.files_before == 0
    assert len(cc.warnings) == 1 and "ignored" in cc.warnings[0] and "starting cold" in cc.warnings[0]
    assert any(m.startswith("WARNING compile cache archive") for m in said)
    base = tmp_path / "worker-a"
    assert [p.name for p in base.iterdir()] == [key]  # no half-unpacked folder left beside it
    assert not (tmp_path / "outside.txt").exists() and not (base.parent / "outside.txt").exists()
    # the start that follows writes a good archive over the bad one
    _compile(FILES)
    compile_cache.publish(cc, said.append)
    assert cc.uploaded
    _worker(monkeypatch, tmp_path, "b")
    again = compile_cache.prepare(store.url, model_dir, EngineConfig(), said.append, options=store.options)
    assert again.hit and _tree(again.local_dir) == FILES


def test_an_unreachable_store_is_a_warning_not_a_failure(model_dir, tmp_path, monkeypatch):
    _worker(monkeypatch, tmp_path, "a")
    opts = {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": "http://127.0.0.1:9"},
            "config_kwargs": {"connect_timeout": 1, "retries": {"max_attempts": 1}}}
    said: list[str] = []
    cc = compile_cache.prepare("s3://nobucket/cc", model_dir, EngineConfig(), said.append, options=opts)
    assert not cc.hit and cc.warnings
    _compile(FILES)
    compile_cache.publish(cc, said.append)
    assert not cc.uploaded and len(cc.warnings) == 2 and "upload" in cc.warnings[1]


def test_two_shards_uploading_at_once_leave_one_complete_archive(store, model_dir, tmp_path, monkeypatch):
    said: list[str] = []
    caches = []
    for name, extra in (("a", b"A" * 300_000), ("b", b"B" * 300_000)):
        _worker(monkeypatch, tmp_path, name)
        cc = compile_cache.prepare(store.url, model_dir, EngineConfig(), said.append, options=store.options)
        _compile({**FILES, f"torch_compile_cache/{name}/big": extra + os.urandom(200_000)})
        caches.append(cc)
    expected = [_tree(cc.local_dir) for cc in caches]
    threads = [threading.Thread(target=compile_cache.publish, args=(cc, said.append)) for cc in caches]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(cc.uploaded for cc in caches), said
    _worker(monkeypatch, tmp_path, "c")
    c = compile_cache.prepare(store.url, model_dir, EngineConfig(), said.append, options=store.options)
    assert c.hit and not c.warnings and _tree(c.local_dir) in expected  # one writer's archive, whole
    if store.url.startswith("file://"):
        assert sorted(p.name for p in Path(store.url.removeprefix("file://")).iterdir()) == \
            [Path(c.archive).name]  # no temporary files left


def test_key_follows_graph_settings_only(model_dir):
    k = compile_cache.cache_key(model_dir, EngineConfig())
    assert compile_cache.cache_key(model_dir, EngineConfig(gpu_memory_utilization=0.5, commit_every_rows=7)) == k
    for changed in (dict(dtype="float16"), dict(max_num_seqs=64), dict(enforce_eager=True), dict(cuda_graphs="vllm"),
                    dict(torch_compile=True),
                    dict(extra={"compilation_config": {"level": 0}})):
        assert compile_cache.cache_key(model_dir, EngineConfig(**changed)) != k, changed
    assert compile_cache.cache_key(model_dir, EngineConfig(), lora_rank=16) != k
    cfg = Path(model_dir) / "config.json"
    cfg.write_text(cfg.read_text().replace("64", "128"))
    assert compile_cache.cache_key(model_dir, EngineConfig()) != k


def test_config_refuses_compile_cache_on_other_engines():
    with pytest.raises(ValueError, match="engine.compile_cache"):
        EngineConfig(kind="transformers", compile_cache="/tmp/x")
    assert EngineConfig(compile_cache="s3://b/cc").compile_cache == "s3://b/cc"


class _CompilingEngine:
    """Stands in for vLLM: at start it reads the cache root from the environment, as vLLM does, and writes
    its artifacts there."""

    seen: list[str] = []

    def __init__(self, *a, **k):
        pass

    def start(self) -> EngineInfo:
        _CompilingEngine.seen.append(os.environ["VLLM_CACHE_ROOT"])
        _compile(FILES)
        return EngineInfo(kind="vllm", version="0", settings={"max_model_len": 2048})

    def close(self) -> None:
        pass


def test_start_engine_syncs_and_records(store, model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(engine_start, "make_engine", _CompilingEngine)
    cfg = demo_config(tmp_path, engine__compile_cache=store.url)
    said: list[str] = []
    _worker(monkeypatch, tmp_path, "a")
    _, info = engine_start.start_engine(model_dir, cfg, said.append, storage_options=store.options)
    rec = info.settings["compile_cache"]
    assert _CompilingEngine.seen[-1] == rec["local_dir"]  # set before the engine started
    assert rec["hit"] is False and rec["uploaded"] is True and rec["files_after"] == 3
    _worker(monkeypatch, tmp_path, "b")
    _, info = engine_start.start_engine(model_dir, cfg, said.append, storage_options=store.options)
    rec = info.settings["compile_cache"]
    assert rec["hit"] is True and rec["downloaded"] is True and rec["uploaded"] is False
    assert "compile_cache" not in engine_start.start_engine(model_dir, demo_config(tmp_path), said.append)[1].settings


def test_the_archive_writer_is_a_file_object_gzip_can_flush(tmp_path):
    """The archive goes through gzip into the atomic writer; gzip's flush() flushes the file object under it."""
    import gzip

    from batch_llm.io.storage import atomic_writer

    with atomic_writer(Location(str(tmp_path / "a.tar.gz")).path()) as w, \
            gzip.GzipFile(fileobj=w, mode="wb", compresslevel=1) as gz:
        gz.write(b"compiled " * 100)
        gz.flush()
    assert gzip.decompress((tmp_path / "a.tar.gz").read_bytes()) == b"compiled " * 100
