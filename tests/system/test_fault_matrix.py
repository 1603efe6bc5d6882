"""The fault matrix: each fault stops the run early with a message that names the culprit and the fix, and
leaves nothing half-written behind (what is committed stays, nothing is written twice).

Faults: a typo'd key in a pipeline file; a word list that is not there; a model folder missing a file; a model
without a chat template; a full output disk. No engine starts here.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from batch_llm import api
from batch_llm.config import ConfigError, load_config
from batch_llm.demo_model import DEMO_MODEL_ID, snapshot_dir
from batch_llm.frontends.cli import main
from batch_llm.io import storage
from batch_llm.io.storage import write_jsonl
from batch_llm.layout import RunLayout
from batch_llm.manifests import PlanManifest, ShardMetrics, ShardResult
from batch_llm.stages.fetch import ModelFolderIncomplete, NoChatTemplate
from helpers import DEMO_YAML, demo_config

ROOT = DEMO_YAML.parents[2]


def write_pipeline(tmp_path: Path, text: str | None = None, name: str = "pipeline.yaml", **replace: str) -> Path:
    """The demo pipeline file in ``tmp_path`` with text replaced (then its relative paths made absolute)."""
    text = text if text is not None else DEMO_YAML.read_text()
    for old, new in replace.items():
        assert old in text, old
        text = text.replace(old, new)
    text = text.replace("../../include", str(ROOT / "include")).replace("../../var", str(tmp_path / "var")) \
        .replace("./wordlists/", str(DEMO_YAML.parent / "wordlists") + "/")
    path = tmp_path / name
    path.write_text(text)
    return path


def no_traceback(err: str) -> None:
    assert "Traceback" not in err and 'File "' not in err, err


def leftovers(directory: Path) -> list[str]:
    """Every file under ``directory`` (temporary ones included)."""
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file()) \
        if directory.exists() else []


# ------------------------------------------------------------------------------------------ 1. a typo'd key
@pytest.mark.parametrize("replace,key,where,suggestion", [
    ({"max_tokens: 48": "max_token: 48"}, "sampling.max_token", "in section 'sampling'", "did you mean 'max_tokens'?"),
    ({"sampling:\n": "sampilng:\n"}, "sampilng", "at the top level", "did you mean 'sampling'?"),
    ({"enforce_eager: true": "enforce_eager: true\n  memory_backoff: {prob: true}"}, "engine.memory_backoff.prob",
     "in section 'engine.memory_backoff'", "did you mean 'probe'?"),
    ({'{name: zh, path: "builtin:zh", action: mask}': '{name: zh, path: "builtin:zh", acton: mask}'},
     "filter.lists.1.acton", "in section 'filter.lists.1'", "did you mean 'action'?"),
    ({"max_model_len: 1024": "temperature: 0.5"}, "engine.temperature", "in section 'engine'",
     "it is a key of section 'sampling' (sampling.temperature)"),
])
def test_typo_names_key_section_file_and_the_closest_key(tmp_path, replace, key, where, suggestion):
    path = write_pipeline(tmp_path, **replace)
    with pytest.raises(ConfigError) as ei:
        load_config(path)
    msg = str(ei.value)
    assert f"{path}: {key}: unknown key {key.rsplit('.', 1)[-1]!r} {where}" in msg and suggestion in msg, msg


def test_typo_through_the_cli(tmp_path):
    """``batch-llm validate``: exit 1, the message on stderr, no traceback; a typo'd --set key alike."""
    path = write_pipeline(tmp_path, **{"max_tokens: 48": "max_token: 48"})
    proc = subprocess.run([sys.executable, "-m", "batch_llm.frontends.cli", "validate", str(path)], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 1, proc
    assert proc.stdout == ""
    assert proc.stderr.strip() == (f"error: {path}: sampling.max_token: unknown key 'max_token' in section "
                                   f"'sampling'; did you mean 'max_tokens'?"), proc.stderr
    good = write_pipeline(tmp_path, name="good.yaml")
    assert main(["validate", str(good)]) == 0
    assert main(["validate", str(good), "--set", "sampling.temprature=0.7"]) == 1


def test_typo_in_a_set_override_names_the_command_line(tmp_path, capsys):
    good = write_pipeline(tmp_path)
    assert main(["validate", str(good), "--set", "engine.max_num_seq=8"]) == 1
    err = capsys.readouterr().err
    no_traceback(err)
    assert f"{good} (command line): engine.max_num_seq: unknown key 'max_num_seq' in section 'engine'; " \
           f"did you mean 'max_num_seqs'?" in err, err


# ------------------------------------------------------------------------------------------ 2. a missing word list
def test_missing_local_word_list_fails_when_the_file_loads(tmp_path):
    path = write_pipeline(tmp_path, **{"demo_watchlist.txt": "no_such_list.txt"})
    missing = DEMO_YAML.parent / "wordlists" / "no_such_list.txt"
    with pytest.raises(ConfigError) as ei:
        load_config(path)
    msg = str(ei.value)
    assert f"{path}: filter.lists.2.path: word list 'watchlist': no such file {missing}" in msg, msg


def test_missing_word_list_stops_the_cli_before_any_stage(tmp_path, capsys, monkeypatch):
    path = write_pipeline(tmp_path, **{"./wordlists/demo_watchlist.txt": "lists/ours.txt"})
    missing = tmp_path / "lists" / "ours.txt"
    monkeypatch.chdir(tmp_path)  # a relative path without ./ is read from the working folder, as the filter stage reads it
    assert main(["validate", str(path)]) == 1
    err = capsys.readouterr().err
    no_traceback(err)
    assert "word list 'watchlist'" in err and str(missing) in err, err
    out = tmp_path / "out"
    assert main(["run", str(path), "--output", str(out)]) == 1
    assert "word list 'watchlist'" in capsys.readouterr().err
    assert not out.exists()  # no stage ran: nothing fetched, planned or inferred
    missing.parent.mkdir()
    missing.write_text("secret\n")
    assert main(["validate", str(path)]) == 0


def test_unknown_builtin_word_list(tmp_path):
    path = write_pipeline(tmp_path, **{'path: "builtin:zh"': 'path: "builtin:fr"'})
    with pytest.raises(ConfigError, match=r"filter.lists.1.path: word list 'zh': no built-in list 'builtin:fr' "
                                          r"\(built-ins: builtin:en, builtin:zh\)"):
        load_config(path)


def test_disabled_filter_does_not_need_its_lists(tmp_path):
    path = write_pipeline(tmp_path, **{"demo_watchlist.txt": "no_such_list.txt",
                                       "filter:\n": "filter:\n  enabled: false\n"})
    assert not load_config(path).filter.enabled


def test_object_storage_word_list_is_checked_when_the_filter_starts(tmp_path):
    """Not at load (that would need the credentials): the filter stage's first act, before a row is read."""
    url = f"memory://lists-{uuid.uuid4().hex}/block.txt"
    path = write_pipeline(tmp_path, **{"./wordlists/demo_watchlist.txt": url})
    cfg = load_config(path).with_overrides({"output.path": str(tmp_path / "out")})
    layout = RunLayout.for_run(cfg, run_id="faults", ds="2026-11-30")
    plan = PlanManifest(input=cfg.input.path, format="jsonl", rows_read=2, valid=2, invalid=0, has_references=False,
                        errors=str(tmp_path / "errors.jsonl"), records=str(tmp_path / "records.jsonl"), shards=[])
    # The shard files do not exist either: the word list's error comes first, so no row was read.
    shards = [ShardResult(shard=0, outputs=str(tmp_path / "shard-0" / "outputs.jsonl"),
                          errors=str(tmp_path / "shard-0" / "e.jsonl"), metrics=ShardMetrics(rows=2))]
    with pytest.raises(FileNotFoundError) as ei:
        api.content_filter(cfg, layout, plan, shards)
    assert ei.value.filename == url and "word list 'watchlist'" in str(ei.value), str(ei.value)
    assert leftovers(Path(layout.stage("filter").url)) == []  # no outputs, no dropped.jsonl, no temporary file


# ------------------------------------------------------------------------------------------ 3. a model folder missing a file
@pytest.fixture
def home(tmp_path, monkeypatch):
    """The fetch stage's hash memo under tmp_path, not in the user's home."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))


def copy_model(src: Path, dest: Path) -> Path:
    """A copy of the demo model: small files copied (tests edit them), the weights linked (never edited)."""
    dest.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            try:
                os.link(f, dest / f.name)
            except OSError:
                (dest / f.name).symlink_to(f)
        else:
            shutil.copy2(f, dest / f.name)
    return dest


def shard_weights(model: Path) -> None:
    """Two shards in model.safetensors.index.json, the second one missing (a download cut short)."""
    (model / "model.safetensors").rename(model / "model-00001-of-00002.safetensors")
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
        "lm_head.weight": "model-00002-of-00002.safetensors"}}))


def truncate_weights(model: Path) -> None:
    whole = model / "model.safetensors"
    head = whole.read_bytes()[:1 << 20]
    whole.unlink()
    whole.write_bytes(head)


@pytest.mark.parametrize("fault,missing", [
    (lambda m: (m / "config.json").unlink(), "config.json"),
    (lambda m: (m / "model.safetensors").unlink(), "the weights (no *.safetensors"),
    (shard_weights, "model-00002-of-00002.safetensors (listed in model.safetensors.index.json)"),
    (truncate_weights, "model.safetensors (truncated: 1048576 of "),
    (lambda m: (m / "tokenizer.json").unlink(), "a tokenizer (none of tokenizer.json"),
])
def test_local_model_folder_missing_a_file(tmp_path, demo_model_dir, home, fault, missing):
    model = copy_model(demo_model_dir, tmp_path / "model")
    fault(model)
    cfg = demo_config(tmp_path, model__ref=str(model))
    layout = RunLayout.for_run(cfg, run_id="faults", ds="2026-11-30")
    with pytest.raises(ModelFolderIncomplete) as ei:
        api.fetch(cfg, layout)
    msg = str(ei.value)
    assert ei.value.filename == str(model) and "the model folder lacks" in msg and missing in msg, msg
    assert "copy them into it" in msg
    assert not Path(layout.run_dir.url).exists()  # no fetch manifest: the shards downstream never start


def test_modelscope_cache_folder_missing_a_file(tmp_path, demo_model_dir, home):
    cache = tmp_path / "modelscope"
    folder = copy_model(demo_model_dir, snapshot_dir(cache))
    (folder / "config.json").unlink()
    cfg = demo_config(tmp_path, model__cache_dir=str(cache))
    assert cfg.model.ref == DEMO_MODEL_ID
    with pytest.raises(ModelFolderIncomplete) as ei:
        api.fetch(cfg, RunLayout.for_run(cfg, run_id="faults", ds="2026-11-30"))
    msg = str(ei.value)
    assert ei.value.filename == str(folder) and "lacks config.json" in msg, msg
    assert "delete the folder so that the next fetch downloads the model again" in msg


def test_a_missing_local_folder(tmp_path, home):
    cfg = demo_config(tmp_path, model__ref=str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="no such folder") as ei:
        api.fetch(cfg, RunLayout.for_run(cfg, run_id="faults", ds="2026-11-30"))
    assert ei.value.filename == str(tmp_path / "nowhere")


# ------------------------------------------------------------------------------------------ 4. no chat template
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}<assistant>"


def test_model_without_chat_template_is_refused_at_fetch(tmp_path, demo_model_dir, home, capsys):
    model = copy_model(demo_model_dir, tmp_path / "model")
    (model / "chat_template.jinja").unlink()
    assert "chat_template" not in json.loads((model / "tokenizer_config.json").read_text())
    cfg = demo_config(tmp_path, model__ref=str(model))
    layout = RunLayout.for_run(cfg, run_id="faults", ds="2026-11-30")
    with pytest.raises(NoChatTemplate) as ei:
        api.fetch(cfg, layout)
    msg = str(ei.value)
    assert str(model) in msg and "has no chat template" in msg and "set model.chat_template" in msg, msg
    assert not Path(layout.run_dir.url).exists()
    # The CLI: exit 1 and the message, no traceback, and no stage after fetch ran (no plan, no shard).
    path = write_pipeline(tmp_path, **{f"ref: {DEMO_MODEL_ID}": f"ref: {model}"})
    out = tmp_path / "cli_out"
    assert main(["run", str(path), "--output", str(out), "--run-id", "cli", "--plain"]) == 1
    err = capsys.readouterr().err
    no_traceback(err)
    assert "has no chat template" in err and "model.chat_template" in err, err
    assert not out.exists()


def test_chat_template_set_in_the_config_is_used(tmp_path, demo_model_dir, home):
    from batch_llm.stages.infer.identity import chat_template_text

    model = copy_model(demo_model_dir, tmp_path / "model")
    (model / "chat_template.jinja").unlink()
    cfg = demo_config(tmp_path, model__ref=str(model), model__chat_template=TEMPLATE)
    m = api.fetch(cfg, RunLayout.for_run(cfg, run_id="faults", ds="2026-11-30"))
    assert m.chat_template == "model.chat_template" and m.local_dir == str(model)
    assert chat_template_text(m.local_dir, cfg.model.chat_template) == TEMPLATE  # what the shards render with


def test_model_template_source_recorded(tmp_path, demo_model_dir, home):
    model = copy_model(demo_model_dir, tmp_path / "model")
    template = (model / "chat_template.jinja").read_text()
    (model / "chat_template.jinja").unlink()
    tc = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**tc, "chat_template": template}))
    cfg = demo_config(tmp_path, model__ref=str(model))
    assert api.fetch(cfg, RunLayout.for_run(cfg, run_id="a", ds="2026-11-30")).chat_template \
        == "tokenizer_config.json"


def test_pre_tokenized_input_can_go_without_a_template(tmp_path, demo_model_dir, home, caplog):
    """Fetch cannot see the input: ``model.require_chat_template: false`` says every row is pre-tokenized."""
    model = copy_model(demo_model_dir, tmp_path / "model")
    (model / "chat_template.jinja").unlink()
    cfg = demo_config(tmp_path, model__ref=str(model), model__require_chat_template=False)
    with caplog.at_level("WARNING", logger="batch_llm.stages.fetch"):
        m = api.fetch(cfg, RunLayout.for_run(cfg, run_id="faults", ds="2026-11-30"))
    assert m.chat_template is None
    assert "only pre-tokenized rows will succeed" in caplog.text


# ------------------------------------------------------------------------------------------ 5. a full output disk
class FullDisk:
    """A folder where writes fail with ENOSPC: a small tmpfs (root, where mounting works), or the atomic
    writer's temporary files sent to /dev/full (the temporary file itself is created, so its removal is seen)."""

    def __init__(self, kind: str, root: Path, monkeypatch):
        self.kind, self.dir, self.full = kind, root / "disk", False
        self.dir.mkdir()
        if kind == "tmpfs":
            if os.geteuid() != 0 or shutil.which("mount") is None:
                pytest.skip("mounting a tmpfs needs root")
            proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(self.dir)],
                                  capture_output=True, text=True)
            if proc.returncode:
                pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
        else:
            real_open = open

            def open_on_full_disk(file, mode="r", *args, **kwargs):
                if self.full and "w" in mode and str(file).startswith(str(self.dir)):
                    real_open(file, mode).close()
                    return real_open("/dev/full", mode, *args, **kwargs)
                return real_open(file, mode, *args, **kwargs)

            monkeypatch.setattr(storage, "open", open_on_full_disk, raising=False)

    def fill(self) -> None:
        self.full = True
        if self.kind == "tmpfs":
            with open(self.dir / "filler", "wb") as f:
                try:
                    f.write(b"\0" * (1 << 17))
                    f.flush()
                except OSError as e:
                    assert e.errno == errno.ENOSPC

    def free(self) -> None:
        self.full = False
        if self.kind == "tmpfs":
            subprocess.run(["mount", "-o", "remount,size=64m", str(self.dir)], check=True)

    def files(self) -> list[str]:
        return [f for f in leftovers(self.dir) if f != "filler"]

    def close(self) -> None:
        if self.kind == "tmpfs" and subprocess.run(["umount", str(self.dir)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(self.dir)], check=False)  # a file left open on it (a failing test)


@pytest.fixture(params=["tmpfs", "dev_full"])
def full_disk(request, tmp_path, monkeypatch):
    disk = FullDisk(request.param, tmp_path, monkeypatch)
    yield disk
    disk.close()


def test_full_disk_mid_stream_leaves_nothing(full_disk):
    """A streamed artifact bigger than the free space: ENOSPC naming the artifact, no object, no temporary."""
    path = full_disk.dir / "run" / "outputs.jsonl"
    if full_disk.kind == "dev_full":
        full_disk.fill()
    rows = ({"id": str(i), "output": "x" * 100} for i in range(5000))  # ~600 kB, the tmpfs holds 64 kB
    with pytest.raises(OSError) as ei:
        write_jsonl(storage.as_path(str(path)), rows)
    assert ei.value.errno == errno.ENOSPC and ei.value.filename == str(path), repr(ei.value)
    assert str(path) in str(ei.value) and "No space left on device" in str(ei.value)
    assert full_disk.files() == []
    full_disk.free()
    assert write_jsonl(storage.as_path(str(path)), ({"id": str(i)} for i in range(5000))) == 5000
    assert full_disk.files() == ["run/outputs.jsonl"]


def test_full_disk_stage_manifest_then_run_again(tmp_path, demo_model_dir, home, full_disk, capsys):
    """The fetch stage's manifest on a full disk: a clear error, no manifest (so nothing downstream goes by a
    half one); with space again the same stage commits once."""
    model = copy_model(demo_model_dir, tmp_path / "model")
    cfg = demo_config(tmp_path, model__ref=str(model)).with_overrides({"output.path": str(full_disk.dir / "out")})
    layout = RunLayout.for_run(cfg, run_id="faults", ds="2026-11-30")
    manifest = Path(layout.stage("fetch").url) / "manifest.json"
    full_disk.fill()
    with pytest.raises(OSError) as ei:
        api.fetch(cfg, layout)
    assert ei.value.errno == errno.ENOSPC and ei.value.filename == str(manifest), repr(ei.value)
    assert full_disk.files() == []
    # The CLI says so in one line, no traceback.
    path = write_pipeline(tmp_path, **{f"ref: {DEMO_MODEL_ID}": f"ref: {model}"})
    assert main(["run", str(path), "--output", str(full_disk.dir / "cli"), "--run-id", "cli", "--plain"]) == 1
    err = capsys.readouterr().err
    no_traceback(err)
    assert "No space left on device" in err and "manifest.json" in err and "free space" in err, err
    assert full_disk.files() == []
    full_disk.free()
    m = api.fetch(cfg, layout)
    assert storage.read_json(storage.as_path(str(manifest)))["content_hash"] == m.content_hash
    assert full_disk.files() == [str(manifest.relative_to(full_disk.dir))]
