"""One config model: errors name the file and the key; a broken pipeline never hides the others."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from batch_llm.config import ConfigError, load_config, parse_config
from helpers import DEMO_YAML, demo_config


def test_demo_config_loads():
    cfg = load_config(DEMO_YAML)
    assert cfg.engine.kind == "vllm" and cfg.sampling.max_tokens == 48


@pytest.mark.parametrize("patch,expected", [
    ("engine:\n  gpu_memory_utilization: 1.5\n", "engine.gpu_memory_utilization"),
    ("sampling:\n  max_tokens: lots\n", "sampling.max_tokens"),
    ("engine:\n  kind: tensorrt\n", "engine.kind"),
    ("filter:\n  lists:\n    - {name: x, path: y, action: burn}\n", "filter.lists.0.action"),
    ("enigne:\n  kind: vllm\n", "enigne"),
])
def test_errors_name_file_and_key(tmp_path, patch, expected):
    text = DEMO_YAML.read_text()
    head = text.split("\nengine:")[0] if patch.startswith("engine") else text
    bad = tmp_path / "broken.yaml"
    bad.write_text(head + "\n" + patch if patch.startswith("engine") else text + "\n" + patch)
    with pytest.raises(ConfigError) as ei:
        load_config(bad)
    msg = str(ei.value)
    assert str(bad) in msg and expected in msg, msg


def test_not_yaml(tmp_path):
    bad = tmp_path / "x.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(ConfigError, match=r"x.yaml: not valid YAML"):
        load_config(bad)


def test_invalid_pipeline_does_not_break_the_others(tmp_path, monkeypatch):
    shutil.copy(DEMO_YAML, tmp_path / "good.yaml")
    (tmp_path / "good.yaml").write_text((tmp_path / "good.yaml").read_text().replace(
        "../../include", str(DEMO_YAML.parents[2] / "include")).replace("../../var", str(tmp_path / "var")))
    (tmp_path / "wordlists").symlink_to(DEMO_YAML.parent / "wordlists")
    (tmp_path / "bad.yaml").write_text("name: bad\nmodel: {ref: a/b}\ninput: {path: x}\noutput: {path: y}\n"
                                       "sampling: {temperature: -1}\n")
    from batch_llm_airflow.dag_factory import build_pipeline_dags

    dags = build_pipeline_dags(tmp_path)
    assert "batch_llm_demo" in dags
    broken = dags["bad__invalid_config"]
    assert "sampling.temperature" in broken.doc_md and "bad.yaml" in broken.doc_md
    assert [t.task_id for t in broken.tasks] == ["report_config_error"]


def _own_dag_files(dags, names: dict[str, str]):
    """A DAGs folder with the folder's DAG file and a pipelines/ folder where each pipeline file (``file stem:
    YAML text``) has its own DAG file, a copy of dags/pipelines/demo.py."""
    folder = dags / "pipelines"
    folder.mkdir(parents=True)
    shutil.copy(DEMO_YAML.parents[1] / "batch_llm_pipelines.py", dags)
    (folder / "wordlists").symlink_to(DEMO_YAML.parent / "wordlists")
    for stem, text in names.items():
        (folder / f"{stem}.yaml").write_text(text)
        shutil.copy(DEMO_YAML.with_suffix(".py"), folder / f"{stem}.py")
    return folder


def _demo_text(tmp_path, name: str = "batch_llm_demo") -> str:
    return DEMO_YAML.read_text().replace("../../include", str(DEMO_YAML.parents[2] / "include")).replace(
        "../../var", str(tmp_path / "var")).replace("name: batch_llm_demo", f"name: {name}")


def test_a_broken_pipeline_is_an_airflow_import_error_and_the_others_load(tmp_path, monkeypatch):
    """Each pipeline file with a DAG file of its own: Airflow's own DagBag lists the broken one's DAG file in
    ``import_errors`` with the config error (where the UI, the REST API and monitoring look), builds the valid
    pipelines' DAGs, and the folder's DAG file builds no second DAG nor an ``__invalid_config`` one for them. A
    second file of an existing name is its own import error; the first file keeps the DAG."""
    from airflow.dag_processing.dagbag import DagBag

    dags = tmp_path / "dags"
    folder = _own_dag_files(dags, {
        "a_good": _demo_text(tmp_path), "b_bad": "name: bad\nmodel: {ref: a/b}\ninput: {path: x}\n"
        "output: {path: y}\nsampling: {temperature: -1}\n", "c_other": _demo_text(tmp_path, "other_pipeline"),
        "d_same": _demo_text(tmp_path)})
    monkeypatch.setenv("BATCH_LLM_PIPELINES_DIR", str(folder))
    bag = DagBag(dag_folder=str(dags))
    errors = {Path(f).name: e for f, e in bag.import_errors.items()}
    assert set(errors) == {"b_bad.py", "d_same.py"}, bag.import_errors
    assert "ConfigError" in errors["b_bad.py"] and "sampling.temperature" in errors["b_bad.py"]
    assert "also the name of" in errors["d_same.py"] and "a_good.yaml" in errors["d_same.py"]
    assert set(bag.dags) == {"batch_llm_demo", "other_pipeline"}
    assert Path(bag.dags["batch_llm_demo"].fileloc).name == "a_good.py"


def test_pipeline_dag_files_stand_aside_for_another_pipelines_folder(tmp_path, monkeypatch):
    """A pipeline's DAG file builds nothing while $BATCH_LLM_PIPELINES_DIR names another folder (a deployment
    that reads its pipelines from there), so its pipeline is not built twice nor raised for."""
    from airflow.dag_processing.dagbag import DagBag

    dags = tmp_path / "dags"
    _own_dag_files(dags, {"b_bad": "name: bad\n"})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.setenv("BATCH_LLM_PIPELINES_DIR", str(elsewhere))
    bag = DagBag(dag_folder=str(dags))
    assert bag.import_errors == {} and bag.dags == {}


def test_a_pipelines_folder_outside_the_dags_folder_is_built_whole(tmp_path, monkeypatch):
    """Pipeline files read from outside the DAGs folder (a copy that kept its ``.py`` files, which Airflow never
    parses there): the folder's DAG file builds every one, a broken one as ``<file>__invalid_config``."""
    from airflow.dag_processing.dagbag import DagBag

    folder = _own_dag_files(tmp_path / "copy", {"a_good": _demo_text(tmp_path), "b_bad": "name: bad\n"})
    monkeypatch.setenv("BATCH_LLM_PIPELINES_DIR", str(folder))
    bag = DagBag(dag_folder=str(DEMO_YAML.parents[1] / "batch_llm_pipelines.py"))
    assert bag.import_errors == {} and set(bag.dags) == {"batch_llm_demo", "b_bad__invalid_config"}


def test_params_override_through_the_same_model(tmp_path, monkeypatch):
    from batch_llm_airflow.params import overrides_from_params, params_for

    monkeypatch.setenv("BATCH_LLM_ALLOWED_LOCAL_ROOTS", "/tmp")  # the form may name word lists under /tmp only

    cfg = load_config(DEMO_YAML)
    params = {k: p.value for k, p in params_for(cfg).items()}
    assert params["filter_lists"][0] == "mask en builtin:en"
    params.update(temperature=0.7, rows_per_shard=5, filter_lists=["drop zh builtin:zh", "flag mine /tmp/w.txt"])
    new = cfg.with_overrides(overrides_from_params(params, cfg))
    assert new.sampling.temperature == 0.7
    assert [(w.action, w.name, w.path) for w in new.filter.lists] == [("drop", "zh", "builtin:zh"),
                                                                     ("flag", "mine", "/tmp/w.txt")]
    with pytest.raises(ConfigError, match=r"filter.lists.0.action"):
        cfg.with_overrides(overrides_from_params({**params, "filter_lists": ["burn zh builtin:zh"]}, cfg))
    assert new.sharding.rows_per_shard == 5 and new.sharding.num_shards is None
    with pytest.raises(ConfigError, match="sampling.top_p"):
        cfg.with_overrides({"sampling.top_p": 2})


def test_shard_sizes_exclude_each_other_by_one_rule_in_yaml_params_and_command_line(tmp_path, monkeypatch):
    """rows_per_shard and num_shards: both in a YAML are refused; in overrides (the trigger form shows both, a
    command line sets one) the size changed from the pipeline's wins and unsets the other, and changing both is
    refused as in the YAML, never one of them dropped silently."""
    from batch_llm.frontends.cli import build_parser, config_from_args
    from batch_llm_airflow.params import overrides_from_params, params_for

    bad = tmp_path / "both.yaml"
    bad.write_text(DEMO_YAML.read_text().replace("  num_shards: 2\n", "  num_shards: 2\n  rows_per_shard: 5\n"))
    with pytest.raises(ConfigError, match="set rows_per_shard or num_shards, not both"):
        load_config(bad)
    cfg = load_config(DEMO_YAML)  # num_shards: 2
    form = {k: p.value for k, p in params_for(cfg).items()}
    assert (form["rows_per_shard"], form["num_shards"]) == (None, 2)

    def from_form(**changes):
        s = cfg.with_overrides(overrides_from_params({**form, **changes}, cfg)).sharding
        return s.rows_per_shard, s.num_shards

    assert from_form() == (None, 2)
    assert from_form(rows_per_shard=5) == (5, None)           # num_shards left as the YAML had it: unset
    assert from_form(num_shards=3) == (None, 3)
    with pytest.raises(ConfigError, match="sharding: .*set rows_per_shard or num_shards, not both"):
        from_form(rows_per_shard=5, num_shards=3)            # both changed: refused, as in the YAML
    args = build_parser().parse_args(["validate", str(DEMO_YAML), "--set", "sharding.rows_per_shard=7"])
    s = config_from_args(args).sharding
    assert (s.rows_per_shard, s.num_shards) == (7, None)


# ------------------------------------------------------------------------------------ engine.speculative
def test_speculative_is_off_by_default_and_reaches_vllm_as_its_speculative_config(tmp_path):
    from batch_llm.engines.vllm_engine import VllmEngine

    plain = demo_config(tmp_path)
    assert plain.engine.speculative is None
    assert "speculative_config" not in VllmEngine("/m", plain.engine, plain.sampling)._constructor_args()
    cfg = demo_config(tmp_path, engine__speculative={"num_speculative_tokens": 3, "prompt_lookup_max": 5})
    args = VllmEngine("/m", cfg.engine, cfg.sampling)._constructor_args()
    assert args["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5,
                                          "prompt_lookup_min": 2}
    # survives the operator's round trip (the task group's JSON dump, parsed in the task)
    assert parse_config(cfg.model_dump(mode="json")).engine.speculative == cfg.engine.speculative


def test_engine_extra_reaches_vllm_as_is_and_wins_key_by_key(tmp_path):
    from batch_llm.engines.vllm_engine import VllmEngine

    def args(**overrides):
        cfg = demo_config(tmp_path, **overrides)
        return VllmEngine("/m", cfg.engine, cfg.sampling)._constructor_args()

    assert "async_scheduling" not in args()  # vLLM's own choice unless the user makes one
    # a key the engine sets itself used to collide with engine.extra's (TypeError: multiple values for keyword)
    assert args(engine__extra={"max_num_seqs": 7})["max_num_seqs"] == 7
    assert args(engine__extra={"seed": 5})["seed"] == 5
    assert args(engine__extra={"async_scheduling": False})["async_scheduling"] is False


def _compilation(monkeypatch, tmp_path, *, gpu=True, takes=("mode", "cudagraph_mode"), lora=None, **overrides):
    """The compilation_config the engine would hand vLLM, on a GPU or not, with a vLLM taking ``takes``."""
    from batch_llm.engines import vllm_engine

    monkeypatch.setattr(vllm_engine, "cuda_visible", lambda: gpu)
    monkeypatch.setattr(vllm_engine, "compilation_config_takes", lambda field: field in takes)
    cfg = demo_config(tmp_path, **{"engine__enforce_eager": False, **overrides})  # the demo runs eager (a CPU)
    engine = vllm_engine.VllmEngine("/m", cfg.engine, cfg.sampling, lora_dir=lora)
    # what reaches vLLM's constructor; with an adapter, that would read the adapter's rank from its folder
    args = engine._compilation_args() if lora else engine._constructor_args()
    return args.get("compilation_config")


def test_offline_cuda_graphs_reach_vllm_on_a_gpu_only_and_step_aside_for_what_they_do_not_cover(tmp_path, monkeypatch):
    from batch_llm.engines.vllm_engine import OFFLINE_CAPTURE_SIZES

    def graphs(**kw):
        config = _compilation(monkeypatch, tmp_path, **kw) or {}
        return {k: v for k, v in config.items() if k.startswith("cudagraph")}

    offline = graphs()
    assert offline["cudagraph_mode"] == "FULL_DECODE_ONLY"
    sizes = offline["cudagraph_capture_sizes"]
    assert sizes == sorted(set(sizes)) and sizes[:8] == [1, 2, 4, 8, 16, 32, 64, 128] and sizes[-1] == 1024
    assert len(sizes) == len(OFFLINE_CAPTURE_SIZES) == 48 and 512 in sizes  # stride 16 up to 512, then 32
    assert {b - a for a, b in zip(sizes[7:], sizes[8:])} == {16, 32} and sizes[sizes.index(512) + 1] == 544
    assert graphs(gpu=False) == {}  # a CPU captures no graphs
    assert graphs(takes=("mode",)) == {}  # a vLLM before cudagraph_mode keeps its own
    assert graphs(engine__cuda_graphs="vllm") == {}
    assert graphs(engine__enforce_eager=True) == {}
    assert graphs(engine__speculative={"num_speculative_tokens": 3}) == {}
    assert graphs(engine__task="embed") == {}
    assert graphs(lora="/adapter") == {}


def test_torch_compile_is_off_by_default_only_where_the_offline_graphs_run(tmp_path, monkeypatch):
    def mode(**kw):
        config = _compilation(monkeypatch, tmp_path, **kw) or {}
        return config.get("mode", config.get("level"))

    assert mode() == 0  # a GPU with the offline graphs: full decode graphs of the uncompiled model
    assert mode(engine__torch_compile=True) is None  # vLLM's own choice (mode 3 on a GPU)
    for elsewhere in (dict(gpu=False), dict(engine__cuda_graphs="vllm"), dict(lora="/adapter"),
                      dict(engine__speculative={"num_speculative_tokens": 3})):
        assert mode(**elsewhere) is None, elsewhere  # no offline graphs: vLLM compiles as it would
        assert mode(engine__torch_compile=False, **elsewhere) == 0, elsewhere
    assert _compilation(monkeypatch, tmp_path, gpu=False, engine__torch_compile=False) == {"mode": 0}
    assert _compilation(monkeypatch, tmp_path, takes=("cudagraph_mode",), engine__torch_compile=False)["level"] == 0
    own = {"cudagraph_capture_sizes": [8]}  # the user's own compilation_config wins whole
    assert _compilation(monkeypatch, tmp_path, engine__extra={"compilation_config": own}) == own
    assert _compilation(monkeypatch, tmp_path, engine__torch_compile=False,
                        engine__extra={"compilation_config": own}) == own
    with pytest.raises(ValueError, match="engine.torch_compile"):
        demo_config(tmp_path, engine__kind="transformers", engine__torch_compile=False)


@pytest.mark.parametrize("speculative,expected", [
    ({"method": "eagle"}, "engine.speculative.method"),
    ({"num_speculative_tokens": 0}, "engine.speculative.num_speculative_tokens"),
    ({"prompt_lookup_min": 5, "prompt_lookup_max": 3}, "prompt_lookup_min (5) is above prompt_lookup_max (3)"),
    ({"lookahead": 2}, "engine.speculative.lookahead"),
])
def test_speculative_bounds(tmp_path, speculative, expected):
    with pytest.raises(ConfigError) as ei:
        demo_config(tmp_path, engine__speculative=speculative)
    assert expected in str(ei.value), str(ei.value)


@pytest.mark.parametrize("kind", ["transformers", "lmdeploy"])
def test_speculative_refused_for_engines_without_it(tmp_path, kind):
    with pytest.raises(ConfigError, match=rf"engine.speculative: n-gram speculative decoding is a vLLM option "
                                          rf".*engine.kind is '{kind}'"):
        demo_config(tmp_path, engine__kind=kind, engine__speculative={})
    with pytest.raises(ConfigError, match="engine.extra.speculative_config: set engine.speculative or"):
        demo_config(tmp_path, engine__speculative={}, engine__extra={"speculative_config": {"method": "ngram"}})


def test_fp8_dynamic_takes_no_w4a16_settings():
    from batch_llm.config import QuantizeConfig

    fp8 = QuantizeConfig(enabled=True, scheme="FP8_DYNAMIC")
    assert fp8.scheme == "FP8_DYNAMIC"
    for key, value in (("method", "rtn"), ("group_size", 64), ("awq_grid", 5), ("calibration_samples", 8)):
        with pytest.raises(ValueError, match=rf"quantize\.{key}: W4A16 settings; scheme FP8_DYNAMIC"):
            QuantizeConfig(enabled=True, scheme="FP8_DYNAMIC", **{key: value})
    with pytest.raises(ValueError, match="scheme"):
        QuantizeConfig(enabled=True, scheme="INT8")


def test_fp8_dynamic_cache_key_is_model_and_scheme_only(tmp_path):
    from batch_llm.config import QuantizeConfig
    from batch_llm.stages import quantize as q

    fp8 = QuantizeConfig(enabled=True, scheme="FP8_DYNAMIC", cache_dir=str(tmp_path))
    w4 = QuantizeConfig(enabled=True, scheme="W4A16", group_size=64, cache_dir=str(tmp_path))
    key = q.cache_entry_dir(fp8, "m@1")
    assert key.name.startswith("m--1-FP8_DYNAMIC-") and key != q.cache_entry_dir(w4, "m@1")
    assert key != q.cache_entry_dir(fp8, "m@2")
    assert q.cache_settings(fp8, "m@1") == {"model_key": "m@1", "scheme": "FP8_DYNAMIC",
                                            "export_version": q.EXPORT_VERSION}
    assert q.resolve_group_size(tmp_path, fp8) == (fp8, "not applicable")  # no config.json needed


def test_recommend_reads_the_quantize_scheme_and_fp8_checkpoints():
    from batch_llm.sizing.recommend import scheme_of

    assert scheme_of(None, "FP8_DYNAMIC") == "fp8" and scheme_of(None, "W4A16") == "w4a16"
    assert scheme_of(None, None) == "bf16" and scheme_of(None, None, "float16") == "fp16"

    def ct(weight_type):
        return {"quantization_config": {"quant_method": "compressed-tensors", "config_groups": {
            "group_0": {"weights": {"type": weight_type, "num_bits": 8 if weight_type == "float" else 4}}}}}
    assert scheme_of(None, None, model_config=ct("float")) == "fp8"
    assert scheme_of(None, None, model_config=ct("int")) == "w4a16"


def test_multiprocessing_is_a_vllm_setting(tmp_path):
    assert demo_config(tmp_path).engine.multiprocessing is None  # vLLM's platform decides: off on CPUs
    assert demo_config(tmp_path, engine__multiprocessing=True).engine.multiprocessing is True
    with pytest.raises(ConfigError, match=r"engine.multiprocessing: vLLM's engine-core process"):
        demo_config(tmp_path, engine__kind="transformers", engine__multiprocessing=False)


@pytest.mark.parametrize("key,value,expected", [
    ("sampling.stop", ["###", ""], "sampling.stop"),           # refused per row before: refused at load now
    ("sampling.seed", -1, "sampling.seed"),                     # vLLM reads -1 as "no seed"
    ("sampling.seed", 2**63, "sampling.seed"),
    ("name", "..", "name"),
    ("name", ".", "name"),
    ("name", "a/b", "name"),
])
def test_values_no_engine_or_path_can_take_are_refused_at_load(tmp_path, key, value, expected):
    with pytest.raises(ConfigError) as ei:
        demo_config(tmp_path, **{key.replace(".", "__"): value})
    assert f": {expected}:" in str(ei.value), str(ei.value)


def test_the_bounds_themselves_are_accepted(tmp_path):
    cfg = demo_config(tmp_path, sampling__seed=2**63 - 1, sampling__stop=["\n\n"], name="daily.v2")
    assert cfg.sampling.seed == 2**63 - 1 and demo_config(tmp_path, sampling__seed=None).sampling.seed is None
