"""The path policy (batch_llm/host/path_policy.py): every path a user can name is classified the way it will be opened,
local ones are checked against the allowed roots after ``..`` and symlinks, files read whole are bounded, YAML is
bounded before it is built, and the templates of paths are checked when a pipeline file is validated."""
from __future__ import annotations

import os
import resource
import shutil
import time

import fsspec
import pytest
from batch_llm.config import ConfigError, load_config
from batch_llm.frontends import cli
from batch_llm.host import path_policy
from batch_llm.io.storage import as_path
from batch_llm.stages.content_filter import load_words
from helpers import DEMO_YAML, ROOT, demo_config


# ------------------------------------------------------------------------------------------ resolution
@pytest.mark.parametrize("form", ["{p}", "file://{p}", "local://{p}", "simplecache::file://{p}",
                                  "simplecache::local://{p}", "{d}/sub/../w.txt", "file://{d}/sub/../w.txt",
                                  "simplecache::file://{d}/sub/../w.txt"])
def test_a_local_url_resolves_to_the_file_fsspec_and_as_path_open(tmp_path, form):
    (tmp_path / "sub").mkdir()
    words = tmp_path / "w.txt"
    words.write_text("secret\n")
    url = form.format(p=words, d=tmp_path)
    r = path_policy.resolve(url)
    assert r.kind == "local" and os.path.realpath(r.local_path) == str(words)
    with fsspec.open(url, "rt") as f:  # what fsspec itself reads at that URL
        assert f.read() == "secret\n"
    assert as_path(url).read_text() == "secret\n"


@pytest.mark.parametrize("url,kind", [
    ("s3://bucket/w.txt", "storage"), ("simplecache::s3://bucket/w.txt", "storage"), ("builtin:en", "builtin"),
    ("http://example.com/w.txt", "other"), ("dir::file:///etc", "other"), ("zip://w.txt::file:///tmp/a.zip", "other"),
    ("S3://bucket/w.txt", "other"), ("relative/words.txt", "local"), ("~/words.txt", "local"),
])
def test_what_each_url_is(url, kind):
    r = path_policy.resolve(url)
    assert r.kind == kind, r
    if url.startswith("~"):
        assert r.local_path == os.path.expanduser(url)


@pytest.mark.parametrize("url", ["file://rel/x", "local://~/x", "file:///a/./b/../c", "file://localhost/x",
                                 "simplecache::file://rel/../x", "local:///tmp//x/"])
def test_local_urls_strip_as_fsspec_strips_them(url):
    from fsspec.core import url_to_fs

    fs, fs_path = url_to_fs(url.split("::")[-1])  # the wrapped target, as fsspec's local filesystem opens it
    assert os.path.realpath(path_policy.local_path(url)) == os.path.realpath(fs_path)


def test_builtin_names_only_the_shipped_lists():
    assert path_policy.builtin_file("builtin:en").parent == path_policy.BUILTIN_WORDLISTS
    for bad in ("builtin:../../config", "builtin:../wordlists/en", "builtin:/etc/passwd", "builtin:fr"):
        with pytest.raises(path_policy.PathRefused, match="no built-in list"):
            path_policy.builtin_file(bad)
        with pytest.raises(FileNotFoundError, match="no built-in list"):
            load_words(bad)


# ------------------------------------------------------------------------------------------ the trigger form
@pytest.fixture
def cfg(monkeypatch):
    monkeypatch.delenv("BATCH_LLM_ALLOWED_LOCAL_ROOTS", raising=False)
    monkeypatch.delenv("AIRFLOW__BATCH_LLM__ALLOWED_LOCAL_ROOTS", raising=False)
    return load_config(DEMO_YAML)


def _form(cfg, **changes) -> dict:
    from batch_llm_airflow.params import params_for

    return {**{k: p.value for k, p in params_for(cfg).items()}, **changes}


def _params(cfg, **changes) -> dict:
    from batch_llm_airflow.params import overrides_from_params

    return overrides_from_params(_form(cfg, **changes), cfg)


@pytest.mark.parametrize("form", ["local://{p}", "simplecache::file://{p}", "blockcache::local://{p}",
                                  "file://{d}/../secret/key.txt"])
def test_the_form_refuses_local_urls_of_every_spelling_outside_the_roots(cfg, tmp_path, monkeypatch, form):
    allowed, secret = tmp_path / "allowed", tmp_path / "secret"
    allowed.mkdir()
    secret.mkdir()
    (secret / "key.txt").write_text("k\n")
    monkeypatch.setenv("BATCH_LLM_ALLOWED_LOCAL_ROOTS", str(allowed))
    url = form.format(p=secret / "key.txt", d=allowed)
    with pytest.raises(ConfigError, match=f"filter_lists names the local path .*{secret}"):
        _params(cfg, filter_lists=[f"flag k {url}"])
    (allowed / "key.txt").write_text("k\n")  # the same spelling under the root passes
    assert _params(cfg, filter_lists=[f"flag k {form.format(p=allowed / 'key.txt', d=allowed / 'x')}"])


def test_the_form_refuses_a_local_model_url_outside_the_roots(cfg, tmp_path):
    with pytest.raises(ConfigError, match=f"model_ref names the local path {tmp_path}"):
        _params(cfg, model_ref=f"local://{tmp_path}")
    with pytest.raises(ConfigError, match="model_ref"):  # a wrapped ref is no model ref fetch reads
        _params(cfg, model_ref=f"simplecache::file://{tmp_path}")


def test_the_form_refuses_builtin_escapes_and_urls_it_cannot_classify(cfg):
    with pytest.raises(ConfigError, match=r"filter_lists: no built-in list 'builtin:../../config'"):
        _params(cfg, filter_lists=["flag k builtin:../../config"])
    for url in ("http://example.com/w.txt", "zip://w.txt::file:///tmp/a.zip", "dir::file:///etc"):
        with pytest.raises(ConfigError, match="neither a local path, an object-storage URL"):
            _params(cfg, filter_lists=[f"flag k {url}"])
    # object storage, wrapped or not, and the shipped lists pass
    assert _params(cfg, filter_lists=["mask en builtin:en", "flag s simplecache::s3://bucket/w.txt"])


def test_the_form_refuses_a_device_or_a_huge_file_as_a_word_list(cfg, tmp_path, monkeypatch):
    monkeypatch.setenv("BATCH_LLM_ALLOWED_LOCAL_ROOTS", f"/dev,{tmp_path}")
    with pytest.raises(ConfigError, match="/dev/zero is not a regular file"):
        _params(cfg, filter_lists=["flag z /dev/zero"])
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="not a regular file"):
        _params(cfg, filter_lists=[f"flag f {fifo}"])
    huge = tmp_path / "huge.txt"
    with open(huge, "wb") as f:  # sparse: no disk used
        f.truncate(path_policy.MAX_WORD_LIST_BYTES + 1)
    with pytest.raises(ConfigError, match="over the 32 MiB limit"):
        _params(cfg, filter_lists=[f"flag h {huge}"])


def test_params_are_built_from_one_dump_of_the_config(cfg, monkeypatch):
    from batch_llm.config import PipelineConfig
    from batch_llm_airflow.params import params_for

    dumps = []
    real = PipelineConfig.model_dump
    monkeypatch.setattr(PipelineConfig, "model_dump", lambda self, **kw: dumps.append(1) or real(self, **kw))
    params_for(cfg)
    assert len(dumps) == 1


# ------------------------------------------------------------------------------------------ the report app
def test_the_report_app_resolves_local_urls_by_the_same_policy(tmp_path, monkeypatch):
    from batch_llm_airflow import report_app
    from batch_llm_airflow.report_app import ReportError

    out, secret = tmp_path / "out", tmp_path / "secret"
    (out / "pipe" / "dt=1" / "v-1").mkdir(parents=True)
    (out / "pipe" / "dt=1" / "v-1" / "report.html").write_text("<p>ok</p>")
    secret.mkdir()
    (secret / "x.html").write_text("<p>secret</p>")
    (out / "pipe" / "link").symlink_to(secret)
    roots = [report_app.Root(f"local://{out}", None, None, "env")]  # a root spelled local:// is a local root
    assert report_app.resolve(f"local://{out}/pipe/dt=1/v-1/report.html", roots).url == \
        str(out / "pipe" / "dt=1" / "v-1" / "report.html")
    for escape in (f"local://{out}/pipe/link/x.html", f"{out}/pipe/link/x.html",
                   f"simplecache::file://{out}/pipe/dt=1/v-1/report.html"):
        with pytest.raises(ReportError) as e:
            report_app.resolve(escape, roots)
        assert e.value.status == 403, escape


# ------------------------------------------------------------------------------------------ bounded reads
def test_word_lists_are_read_with_a_bound(tmp_path):
    huge = tmp_path / "huge.txt"
    with open(huge, "wb") as f:
        f.truncate(path_policy.MAX_WORD_LIST_BYTES + 1)
    with pytest.raises(path_policy.PathRefused, match="over the 32 MiB limit"):
        load_words(str(huge))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # opened without blocking, refused before a read
    with pytest.raises(path_policy.PathRefused, match="not a regular file"):
        load_words(f"file://{fifo}")
    with pytest.raises(path_policy.PathRefused, match="not a regular file"):
        path_policy.read_local_bounded("/dev/zero", 1024)


def test_a_pipeline_file_naming_a_device_as_word_list_is_refused_saying_so(tmp_path):
    text = DEMO_YAML.read_text().replace("../../include", str(ROOT / "include")).replace("../../var", str(tmp_path))
    path = tmp_path / "p.yaml"
    path.write_text(text + "\nfilter:\n  lists:\n    - {name: z, path: /dev/zero, action: flag}\n")
    with pytest.raises(ConfigError, match=r"filter.lists.0.path: word list 'z': /dev/zero is not a regular file"):
        load_config(path)


# ------------------------------------------------------------------------------------------ YAML
def _bomb(levels: int, width: int = 8) -> str:
    """engine.extra holding YAML aliases that expand to width**levels values."""
    lines = [f"    a0: &a0 [{', '.join(['x'] * width)}]"]
    for i in range(1, levels):
        lines.append(f"    a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * width)}]")
    return ("name: bomb\nmodel: {ref: a/b}\ninput: {path: /tmp/in}\noutput: {path: /tmp/out}\n"
            "engine:\n  extra:\n" + "\n".join(lines) + "\n")


def test_validate_refuses_a_yaml_alias_bomb_quickly(tmp_path, capsys):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(_bomb(10))  # 8**10: a billion values
    t0 = time.monotonic()
    assert cli.main(["validate", str(bomb)]) == 1
    assert time.monotonic() - t0 < 5
    err = capsys.readouterr().err
    assert f"{bomb}: expands to more than 100,000 values" in err and len(err.strip().splitlines()) == 1


def test_yaml_that_holds_itself_or_nests_too_deep_is_refused():
    with pytest.raises(ValueError, match="refers to a value that holds it"):
        path_policy.load_yaml("a: &a [1, *a]\n")
    with pytest.raises(ValueError, match="nested deeper than"):
        path_policy.load_yaml("a: " + "[" * 2000 + "]" * 2000 + "\n")
    assert path_policy.load_yaml("a: &x {b: 1}\nc: *x\n") == {"a": {"b": 1}, "c": {"b": 1}}  # aliases still work


def _good_pipeline(folder, tmp_path):
    shutil.copy(DEMO_YAML, folder / "good.yaml")
    (folder / "good.yaml").write_text((folder / "good.yaml").read_text().replace(
        "../../include", str(ROOT / "include")).replace("../../var", str(tmp_path / "var")))
    (folder / "wordlists").symlink_to(DEMO_YAML.parent / "wordlists")


def test_a_broken_pipeline_file_costs_only_its_own_dag(tmp_path, monkeypatch):
    from airflow.dag_processing.dagbag import DagBag

    folder = tmp_path / "pipelines"
    folder.mkdir()
    _good_pipeline(folder, tmp_path)
    (folder / "bomb.yaml").write_text(_bomb(6))  # 8**6 values: once per param, the DAG file took minutes
    (folder / "when.yaml").write_text("name: when\nmodel: {ref: a/b}\ninput: {path: /tmp/in}\n"
                                      "output: {path: /tmp/out}\nairflow: {start_date: tomorrow}\n")
    monkeypatch.setenv("BATCH_LLM_PIPELINES_DIR", str(folder))
    t0 = time.monotonic()
    bag = DagBag(dag_folder=str(ROOT / "dags" / "batch_llm_pipelines.py"))
    assert time.monotonic() - t0 < 60
    assert bag.import_errors == {}
    assert "batch_llm_demo" in bag.dags
    assert "expands to more than" in bag.dags["bomb__invalid_config"].doc_md
    assert "start_date" in bag.dags["when__invalid_config"].doc_md or "tomorrow" in bag.dags["when__invalid_config"].doc_md


def _big_pipeline(folder, tmp_path, name: str) -> None:
    """A valid pipeline file of about 0.8 MB: a long few-shot system prompt and the most stop strings allowed."""
    from batch_llm.config.sampling import MAX_STOP_STRINGS

    text = (folder / "good.yaml").read_text().replace("name: batch_llm_demo", f"name: {name}")
    prompt = "".join(f"    Example {n}: answer the review in one short sentence, politely, without names.\n"
                     for n in range(9700))
    stops = "[" + ", ".join(f"'stop-{n}'" for n in range(MAX_STOP_STRINGS)) + "]"
    text = text.replace("input:\n", "input:\n  system_prompt: |\n" + prompt, 1)
    (folder / f"{name}.yaml").write_text(text.replace("sampling:\n", f"sampling:\n  stop: {stops}\n", 1))


def test_twelve_big_pipeline_files_load_well_within_the_import_timeout(tmp_path, monkeypatch):
    """Twelve valid 0.8 MB pipeline files all become DAGs, parsed by libyaml in a fraction of the CPU time the
    pure-Python loader took (over 2 s of CPU, 5 s of wall time on a busy machine; with more values in each file
    past Airflow's 30 s import timeout); a file over the size limit beside them is refused alone."""
    import yaml
    from airflow.dag_processing.dagbag import DagBag
    from batch_llm_airflow import dag_factory, task_group  # noqa: F401 - imported before the clock starts

    folder = tmp_path / "pipelines"
    folder.mkdir()
    _good_pipeline(folder, tmp_path)
    for i in range(12):
        _big_pipeline(folder, tmp_path, f"big_{i:02d}")
    assert 0.7e6 < (folder / "big_00.yaml").stat().st_size < path_policy.MAX_PIPELINE_FILE_BYTES
    (folder / "huge.yaml").write_text((folder / "big_00.yaml").read_text().replace("big_00", "huge") + "#" * 2**19)
    (folder / "good.yaml").unlink()
    monkeypatch.setenv("BATCH_LLM_PIPELINES_DIR", str(folder))
    # the CPU bound below is the measure; wall-clock limits would make it depend on the machine's other load
    monkeypatch.setenv("AIRFLOW__CORE__DAGBAG_IMPORT_TIMEOUT", "600")
    if yaml.__with_libyaml__:
        assert path_policy._safe_loader() is yaml.CSafeLoader
    # user CPU: the kernel's page reclaim on a machine short of memory (system time) is not the parse's cost
    t0 = resource.getrusage(resource.RUSAGE_SELF).ru_utime
    bag = DagBag(dag_folder=str(ROOT / "dags" / "batch_llm_pipelines.py"))
    cpu = resource.getrusage(resource.RUSAGE_SELF).ru_utime - t0
    assert bag.import_errors == {}
    assert sorted(d for d in bag.dags if d.startswith(("big_", "huge"))) == [
        *(f"big_{i:02d}" for i in range(12)), "huge__invalid_config"]
    assert "over the 1 MiB limit" in bag.dags["huge__invalid_config"].doc_md
    assert cpu < 1.5, f"{cpu:.2f} s of user CPU to build the DAGs of twelve pipeline files"


def test_two_pipeline_files_of_one_name_keep_the_first_file_s_dag(tmp_path):
    """A pipeline's name is its DAG id: the first file by name keeps the DAG, a later file of the same name is
    an invalid pipeline naming both files, never a silent replacement."""
    from batch_llm_airflow.dag_factory import build_pipeline_dags

    _good_pipeline(tmp_path, tmp_path)
    shutil.copy(tmp_path / "good.yaml", tmp_path / "a_copy.yaml")
    shutil.move(tmp_path / "good.yaml", tmp_path / "z_late.yaml")
    dags = build_pipeline_dags(tmp_path)
    assert sorted(dags) == ["batch_llm_demo", "z_late__invalid_config"]
    assert "`a_copy.yaml`" in dags["batch_llm_demo"].doc_md
    doc = dags["z_late__invalid_config"].doc_md
    assert f"{tmp_path / 'z_late.yaml'}: name: 'batch_llm_demo' is also the name of {tmp_path / 'a_copy.yaml'}" in doc


def test_pipeline_files_reached_after_the_import_budget_are_each_refused(tmp_path):
    """Loading pipeline files stops at the DAG file's budget (a share of Airflow's import timeout): each file
    not loaded is its own invalid pipeline saying so, and the DAG file still imports."""
    from batch_llm_airflow.dag_factory import IMPORT_BUDGET_SHARE, build_pipeline_dags, import_budget_s

    assert import_budget_s() == 30 * IMPORT_BUDGET_SHARE   # Airflow's default dagbag_import_timeout
    _good_pipeline(tmp_path, tmp_path)
    dags = build_pipeline_dags(tmp_path, budget_s=0.0)
    assert list(dags) == ["good__invalid_config"]
    assert "not loaded: the pipeline files before it took" in dags["good__invalid_config"].doc_md


def test_a_task_s_process_loads_only_the_pipeline_files_that_may_be_its_dag(tmp_path, monkeypatch):
    """In a task's process (Airflow's parsing context names its DAG) only the files naming that pipeline are
    loaded; a DAG id of an invalid file, or a name no file spells out, loads every file as the DAG processor
    does."""
    from batch_llm_airflow import dag_factory

    _good_pipeline(tmp_path, tmp_path)
    for other in ("other_a", "other_b"):
        (tmp_path / f"{other}.yaml").write_text((tmp_path / "good.yaml").read_text().replace(
            "name: batch_llm_demo", f"name: {other}").replace("description: ", "description: not batch_llm_demo; "))
    loaded: list[str] = []
    real = dag_factory.load_config
    monkeypatch.setattr(dag_factory, "load_config", lambda path: loaded.append(path.name) or real(path))
    monkeypatch.setenv("_AIRFLOW_PARSING_CONTEXT_DAG_ID", "batch_llm_demo")
    assert list(dag_factory.build_pipeline_dags(tmp_path)) == ["batch_llm_demo"] and loaded == ["good.yaml"]
    for dag_id in ("other_b__invalid_config", "nowhere"):
        loaded.clear()
        monkeypatch.setenv("_AIRFLOW_PARSING_CONTEXT_DAG_ID", dag_id)
        assert len(dag_factory.build_pipeline_dags(tmp_path)) == 3 and len(loaded) == 3


# ------------------------------------------------------------------------------------------ output schema $ref
@pytest.mark.parametrize("schema", [
    '{"$ref": "#"}',
    '{"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}',
    '{"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}}',
])
def test_a_schema_whose_ref_reaches_itself_is_refused_at_validation(tmp_path, schema):
    path = tmp_path / "schema.json"
    path.write_text(schema)
    with pytest.raises(ConfigError, match=r"sampling.output_schema: .*\$ref cycle: #"):
        demo_config(tmp_path, sampling__output_schema=str(path))


def test_a_schema_ref_to_nothing_or_outside_is_refused_and_shared_refs_pass(tmp_path):
    with pytest.raises(ConfigError, match=r"sampling.output_schema: .*'#/\$defs/nope' points at no schema"):
        demo_config(tmp_path, sampling__output_schema={"$ref": "#/$defs/nope"})
    with pytest.raises(ConfigError, match="only references inside the schema"):
        demo_config(tmp_path, sampling__output_schema={"$ref": "https://example.com/s.json"})
    shared = {"$defs": {"s": {"type": "string"}}, "type": "object",
              "properties": {"a": {"$ref": "#/$defs/s"}, "b": {"$ref": "#/$defs/s"}, "$ref": {"type": "integer"}}}
    assert demo_config(tmp_path, sampling__output_schema=shared).sampling.output_schema == shared


# ------------------------------------------------------------------------------------------ partition and --output
@pytest.mark.parametrize("partition,reason", [
    ("../x", "is a path, not one folder name"), ("{ds}/../../x", "is a path"), ("/abs", "is a path"),
    ("..", "its parent"), ("runs", "run folders"), ("dt={date}", r"unknown placeholder \{date\}; the placeholders "
                                                                  r"allowed: \{ds\}"),
    ("dt={}", r"unknown placeholder \{\}"), ("dt={ds", "literal brace"),
])
def test_the_partition_must_be_one_folder_of_the_pipeline(tmp_path, partition, reason):
    with pytest.raises(ConfigError, match=f"output.partition: .*{reason}"):
        demo_config(tmp_path, output__partition=partition)


def test_validate_names_an_unknown_placeholder_in_one_line(capsys):
    assert cli.main(["validate", str(DEMO_YAML), "--set", "output.partition=day={day}"]) == 1
    err = capsys.readouterr().err.strip()
    assert "output.partition" in err and "{day}" in err and "{ds}" in err and len(err.splitlines()) == 1
    assert cli.main(["validate", str(DEMO_YAML), "--set", "input.path=/data/{date}.jsonl"]) == 1
    assert "input.path" in capsys.readouterr().err


def test_a_run_date_cannot_fill_the_partition_out_of_the_pipeline(tmp_path):
    from batch_llm.layout import RunLayout

    cfg = demo_config(tmp_path, output__partition="{ds}")
    assert RunLayout.for_run(cfg, run_id="r", ds="2026-01-02").partition == "2026-01-02"
    with pytest.raises(ConfigError, match="output.partition"):
        RunLayout.for_run(cfg, run_id="r", ds="../../elsewhere")


@pytest.mark.parametrize("below", ["", "/sub"])
def test_output_naming_a_file_is_one_error_line(tmp_path, capsys, below):
    a_file = tmp_path / "afile"
    a_file.write_text("x")
    assert cli.main(["run", str(DEMO_YAML), "--output", f"{a_file}{below}", "--plain"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: output.path:") and str(a_file) in err and len(err.splitlines()) == 1
    assert a_file.read_text() == "x"
