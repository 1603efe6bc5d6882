"""``batch-llm infer``'s ms-swift flags (include/batch_llm/frontends/swift.py): each flag's YAML key, refusals and
warnings, the rows swift reads, the result line's shape, and docs/ms-swift.md's table against ``FLAGS``. No engine."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from batch_llm.config import ConfigError
from batch_llm.frontends import swift as sa
from batch_llm.frontends import swift_fields
from batch_llm.frontends.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
# the `swift infer` command of a real run on this project's CPU machines (ms-swift 4.6.0, vLLM backend)
SWIFT_RUN = ("--model_type llama --template chatml --template_backend jinja --infer_backend vllm --val_dataset "
             "rows.jsonl --stream false --temperature 0 --max_new_tokens 128 --vllm_enforce_eager true "
             "--vllm_max_model_len 2048 --result_path out.jsonl").split()


def _plan(*words: str) -> sa.InferPlan:
    return sa.plan_invocation(sa.parse_swift_args(["--model", "m", "--val_dataset", "rows.jsonl",
                                                   "--result_path", "out.jsonl", *words]))


def test_the_swift_run_maps_onto_yaml_keys(tmp_path):
    inv = sa.parse_swift_args(["--model", str(tmp_path), *SWIFT_RUN])
    plan = sa.plan_invocation(inv)
    assert plan.overrides == {"engine.kind": "vllm", "model.ref": str(tmp_path), "sampling.temperature": 0.0,
                              "sampling.max_tokens": 128, "engine.enforce_eager": True, "engine.max_model_len": 2048}
    assert plan.warnings == []
    assert {n.split(":")[0] for n in plan.notes} == {"--model_type", "--template", "--template_backend", "--stream"}
    cfg = sa.build_config(plan, tmp_path / "work")
    assert (cfg.engine.kind, cfg.engine.enforce_eager, cfg.engine.max_model_len) == ("vllm", True, 2048)
    assert (cfg.sampling.max_tokens, cfg.sampling.temperature, cfg.sharding.num_shards) == (128, 0.0, 1)
    assert not cfg.filter.enabled and not cfg.evaluate.enabled
    assert cfg.input.path == str(tmp_path / "work" / "rows.jsonl")
    assert plan.result_path == str(Path("out.jsonl").resolve())


@pytest.mark.parametrize("words, key, value", [
    (["--infer_backend", "pt", "--max_batch_size", "4"], "engine.batch_size", 4),
    (["--infer_backend", "transformers", "--top_p", "0.9"], "sampling.top_p", 0.9),
    (["--infer_backend", "vllm", "--vllm_gpu_memory_utilization", "0.8"], "engine.gpu_memory_utilization", 0.8),
    (["--infer_backend", "vllm", "--vllm_tensor_parallel_size", "2"], "engine.tensor_parallel_size", 2),
    (["--infer_backend", "vllm", "--vllm_max_num_seqs", "64"], "engine.max_num_seqs", 64),
    (["--infer_backend", "vllm", "--vllm_enable_prefix_caching", "false"], "engine.enable_prefix_caching", False),
    (["--infer_backend", "vllm", "--vllm_enforce_eager"], "engine.enforce_eager", True),  # a bare bool is true
    (["--infer_backend", "vllm", "--vllm_max_model_len=4096"], "engine.max_model_len", 4096),
    (["--infer_backend", "vllm", "--gpu_memory_utilization", "0.7"], "engine.gpu_memory_utilization", 0.7),
    (["--infer_backend", "vllm", "--vllm_engine_kwargs", '{"max_logprobs": 30}'], "engine.extra.max_logprobs", 30),
    (["--infer_backend", "lmdeploy", "--lmdeploy_tp", "2"], "engine.tensor_parallel_size", 2),
    (["--infer_backend", "lmdeploy", "--lmdeploy_session_len", "4096"], "engine.max_model_len", 4096),
    (["--infer_backend", "lmdeploy", "--lmdeploy_cache_max_entry_count", "0.5"], "engine.gpu_memory_utilization",
     0.5),
    (["--infer_backend", "lmdeploy", "--lmdeploy_quant_policy", "8"], "engine.kv_cache_dtype", "int8"),
    (["--stop_words", "###", "END"], "sampling.stop", ["###", "END"]),
    (["--infer_backend", "vllm", "--logprobs", "true", "--top_logprobs", "3"], "sampling.logprobs", 3),
    (["--system", "Be brief."], "input.system_prompt", "Be brief."),
    (["--seed", "7"], "sampling.seed", 7),
    (["--torch_dtype", "float32"], "engine.dtype", "float32"),
])
def test_flag_sets_its_key(words, key, value, tmp_path):
    plan = _plan(*words)
    assert plan.overrides[key] == value
    sa.build_config(plan, tmp_path)  # the config model takes it


@pytest.mark.parametrize("backend", ["vllm", "pt"])
def test_top_k_repetition_penalty_and_enable_thinking_reach_the_sampling(backend, tmp_path):
    plan = _plan("--infer_backend", backend, "--top_k", "20", "--repetition_penalty", "1.1", "--enable_thinking",
                 "false")
    s = sa.build_config(plan, tmp_path).sampling
    assert (s.top_k, s.repetition_penalty, s.chat_template_kwargs) == (20, 1.1, {"enable_thinking": False})
    assert sa.build_config(_plan("--top_k", "-1"), tmp_path).sampling.top_k == 0  # swift's "off", one value


def test_a_rows_chat_template_kwargs_is_its_own(tmp_path):
    rows = [{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"enable_thinking": True}},
            {"query": "plain"}]
    assert sa.input_rows(rows) == [
        {"id": sa.row_id(0), "messages": [{"role": "user", "content": "hi"}],
         "chat_template_kwargs": {"enable_thinking": True}},
        {"id": sa.row_id(1), "messages": [{"role": "user", "content": "plain"}]}]
    assert sa.build_config(_plan(), tmp_path).input.sampling_columns == ["chat_template_kwargs"]


# ------------------------------------------------------------------------------------------ after swift sft
def _checkpoint(tmp_path: Path, **args) -> Path:
    """A `swift sft` checkpoint folder: the adapter's files and the training's args.json."""
    ckpt = tmp_path / "output" / "v0-20261204-120000" / "checkpoint-100"
    ckpt.mkdir(parents=True)
    (ckpt / "adapter_config.json").write_text(json.dumps({"r": 8, "peft_type": "LORA"}))
    trained = {"model": "Qwen/Qwen2.5-0.5B-Instruct", "model_type": "qwen2_5", "model_revision": "master",
               "template": "qwen2_5", "system": "You are a support agent.", "max_length": 2048,
               "torch_dtype": "bfloat16", "max_model_len": None, "adapters": [], "learning_rate": 1e-4, **args}
    (ckpt / "args.json").write_text(json.dumps(trained))
    return ckpt


def _after_sft(*words: str) -> sa.InferPlan:
    return sa.plan_invocation(sa.parse_swift_args(["--val_dataset", "rows.jsonl", "--result_path", "out.jsonl",
                                                   *words]))


def test_adapters_without_model_read_the_checkpoints_args_json(tmp_path):
    ckpt = _checkpoint(tmp_path)
    plan = _after_sft("--adapters", str(ckpt), "--merge_lora", "true", "--infer_backend", "vllm")
    assert plan.overrides["model.ref"] == "Qwen/Qwen2.5-0.5B-Instruct" and plan.overrides["model.revision"] == "master"
    assert plan.overrides["model.lora"] == {"ref": str(ckpt), "merge": True}
    assert plan.overrides["input.system_prompt"] == "You are a support agent."
    assert plan.overrides["engine.dtype"] == "bfloat16"
    assert "engine.max_model_len" not in plan.overrides  # null in args.json: not set
    (note,) = [n for n in plan.notes if "args.json" in n]
    assert note.startswith(f"{ckpt / 'args.json'}: --model Qwen/Qwen2.5-0.5B-Instruct, --model_type qwen2_5")
    assert "--max_length" not in note  # swift does not load the training's max_length for inference either
    cfg = sa.build_config(plan, tmp_path / "work")
    assert cfg.model.lora is not None and cfg.model.lora.merge and cfg.model.lora.ref == str(ckpt)


def test_the_command_line_wins_over_args_json_and_load_args_false_reads_none(tmp_path):
    ckpt = _checkpoint(tmp_path, max_model_len=4096)
    plan = _after_sft("--adapters", str(ckpt), "--model", "Qwen/Other", "--system", "Mine.", "--infer_backend", "vllm")
    assert (plan.overrides["model.ref"], plan.overrides["input.system_prompt"]) == ("Qwen/Other", "Mine.")
    assert plan.overrides["engine.max_model_len"] == 4096 and plan.overrides["engine.dtype"] == "bfloat16"
    with pytest.raises(ConfigError, match="--model: required .* or --adapters CHECKPOINT whose args.json"):
        _after_sft("--adapters", str(ckpt), "--load_args", "false")
    with pytest.raises(ConfigError, match="--model: required"):
        _after_sft("--adapters", str(tmp_path / "no-such-checkpoint"))


def test_merge_lora_false_serves_the_adapter_on_vllm_only(tmp_path):
    ckpt = _checkpoint(tmp_path)
    plan = _after_sft("--adapters", str(ckpt), "--merge_lora", "false", "--infer_backend", "vllm")
    assert plan.overrides["model.lora"] == {"ref": str(ckpt), "merge": False}
    assert not sa.build_config(plan, tmp_path / "work").model.lora.merge
    with pytest.raises(ConfigError, match="model.lora.merge: false serves the adapter unmerged"):
        sa.build_config(_after_sft("--adapters", str(ckpt), "--merge_lora", "false"), tmp_path / "pt")
    with pytest.raises(ConfigError, match="--merge_lora: needs --adapters"):
        _plan("--merge_lora", "true")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "args.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="args.json: expected a JSON object"):
        _after_sft("--adapters", str(tmp_path / "bad"))


def test_pt_is_the_transformers_engine():
    assert _plan("--infer_backend", "pt").overrides["engine.kind"] == "transformers"
    assert _plan().overrides["engine.kind"] == "transformers"  # swift 4.x's default backend


@pytest.mark.parametrize("words, named", [
    (["--frobnicate", "1"], "--frobnicate"),
    (["--vllm_swap_space", "4"], "--vllm_swap_space"),
    (["--top_k", "many"], "--top_k"),
    (["--enable_thinking", "maybe"], "--enable_thinking"),
    (["--num_beams", "4"], "--num_beams 4"),
    (["--infer_backend", "tgi"], "--infer_backend tgi"),
    (["--infer_backend", "sglang", "--sglang_dp_size", "2"], "--sglang_dp_size 2"),
    (["--infer_backend", "vllm", "--vllm_pipeline_parallel_size", "2"], "--vllm_pipeline_parallel_size 2"),
    (["--dataset", "AI-ModelScope/alpaca-gpt4-data-zh"], "--dataset"),
    (["--max_new_tokens"], "--max_new_tokens: expected a value"),
    (["--max_new_tokens", "lots"], "--max_new_tokens"),
    (["--temperature", "0", "1"], "--temperature: expected one value"),
    (["--vllm_enforce_eager", "maybe"], "--vllm_enforce_eager"),
    (["--adapters", "a", "b"], "--adapters a b"),
    (["--top_logprobs", "2"], "--top_logprobs: needs --logprobs true"),
    (["stray"], "--result_path: expected one value, got 2: out.jsonl stray"),
])
def test_unknown_or_refused_flag_is_an_error_naming_it(words, named):
    with pytest.raises(ConfigError) as e:
        _plan(*words)
    assert named in str(e.value)


def test_refused_flags_at_neutral_values_pass():
    plan = _plan("--num_beams", "1", "--use_hf", "false", "--streaming", "false")
    assert plan.warnings == []


def test_required_flags():
    for missing in ("--model", "--val_dataset", "--result_path"):
        words = ["--model", "m", "--val_dataset", "r.jsonl", "--result_path", "o.jsonl"]
        i = words.index(missing)
        with pytest.raises(ConfigError, match=missing):
            sa.plan_invocation(sa.parse_swift_args(words[:i] + words[i + 2:]))


def test_harmless_flags_warn_and_other_backends_flags_are_ignored():
    plan = _plan("--infer_backend", "pt", "--vllm_max_model_len", "1024", "--metric", "rouge", "--template_backend",
                 "swift", "--write_batch_size", "1000")
    assert "engine.max_model_len" not in plan.overrides
    said = "\n".join(plan.warnings)
    assert "--vllm_max_model_len: ignored" in said and "--metric rouge" in said and "--template_backend swift" in said
    assert any(n.startswith("--write_batch_size") for n in plan.notes)
    assert "engine.batch_size" not in _plan("--infer_backend", "vllm", "--max_batch_size", "8").overrides


def test_a_config_refusal_names_the_key(tmp_path):
    # LMDeploy refuses enforce_eager under TurboMind etc.; here: tensor_parallel_size > 1 on transformers
    plan = _plan("--infer_backend", "pt", "--max_batch_size", "2", "--torch_dtype", "float32")
    plan.overrides["engine.tensor_parallel_size"] = 2
    with pytest.raises(ConfigError, match="engine.tensor_parallel_size"):
        sa.build_config(plan, tmp_path)


def test_own_options_and_the_infer_subcommand():
    inv = sa.parse_swift_args(["--model", "m", "--plain", "--work-dir", "w", "-v", "--print-config"])
    assert (inv.plain, inv.verbose, inv.print_config, inv.work_dir) == (True, True, True, "w")
    args = build_parser().parse_args(["infer", "--model", "m", "--val_dataset", "a.jsonl", "b.jsonl", "-v"])
    assert args.command == "infer" and args.swift_args == ["--model", "m", "--val_dataset", "a.jsonl", "b.jsonl", "-v"]
    assert sa.parse_swift_args(args.swift_args).values["val_dataset"] == ["a.jsonl", "b.jsonl"]


# ------------------------------------------------------------------------------------------ rows and results
ROWS = [
    {"id": 7, "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q1"}]},
    {"messages": [{"role": "user", "content": "Q2"}, {"role": "assistant", "content": "gold"}], "label": 1},
    {"query": "Q3", "response": "R3", "system": "S3", "history": [["h", "hr"]]},
]


def _write_rows(tmp_path: Path) -> Path:
    f = tmp_path / "rows.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return f


def test_rows_in_order_with_samples(tmp_path):
    f = _write_rows(tmp_path)
    assert [r.get("query") for r in sa.read_swift_rows([str(f), f"{f}#1"], None)] == [None, None, "Q3", None]
    assert len(sa.read_swift_rows([str(f)], 2)) == 2
    pipeline_rows = sa.input_rows(sa.read_swift_rows([str(f)], None))
    assert [r["id"] for r in pipeline_rows] == ["r000000000", "r000000001", "r000000002"]
    assert pipeline_rows[1]["messages"] == [{"role": "user", "content": "Q2"}]  # the label is not prompted
    assert pipeline_rows[2]["messages"] == [{"role": "system", "content": "S3"}, {"role": "user", "content": "h"},
                                            {"role": "assistant", "content": "hr"}, {"role": "user", "content": "Q3"}]
    with pytest.raises(ConfigError, match="no such file"):
        sa.read_swift_rows([str(tmp_path / "missing.jsonl")], None)


@pytest.mark.parametrize("row, why", [({"text": "x"}, "needs 'messages'"),
                                      ({"messages": [{"role": "user", "content": "x"}], "images": ["a.png"]},
                                       "'images'"),
                                      ({"messages": [{"role": "assistant", "content": "x"}]}, "no prompt")])
def test_rows_swift_would_read_differently_are_refused(row, why):
    with pytest.raises(ConfigError, match=why):
        sa.split_row({"_where": "f: line 1", **row})


def test_result_lines_have_swifts_shape(tmp_path):
    rows = sa.read_swift_rows([str(_write_rows(tmp_path))], None)
    tokens = [{"token": "A", "logprob": -0.1, "top": [{"token": "A", "logprob": -0.1}]}]
    outputs = {"r000000000": {"id": "r000000000", "output": "A1", "logprobs": tokens, "finish_reason": "stop"},
               "r000000002": {"id": "r000000002", "output": "A3"}}
    lines = sa.result_lines(rows, outputs, {"r000000001": "prompt too long"})
    assert sa.swift_logprobs([{"token": "é", "logprob": -1.0, "top": []}]) == \
        {"content": [{"token": "é", "logprob": -1.0, "bytes": [195, 169]}]}  # no candidates asked: no top_logprobs
    assert lines[0] == {"response": "A1", "labels": None,
                        "logprobs": {"content": [{"token": "A", "logprob": -0.1, "bytes": [65],
                                                  "top_logprobs": [{"token": "A", "logprob": -0.1, "bytes": [65]}]}]},
                        "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q1"},
                                     {"role": "assistant", "content": "A1"}]}
    assert list(lines[0]) == ["response", "labels", "logprobs", "messages"]  # swift's key order
    assert lines[1] == {"response": None, "labels": "gold", "logprobs": None,
                        "messages": [{"role": "user", "content": "Q2"}], "label": 1, "error": "prompt too long"}
    assert lines[2]["labels"] == "R3" and lines[2]["messages"][-1] == {"role": "assistant", "content": "A3"}
    out = tmp_path / "out.jsonl"
    sa.append_jsonl(str(out), lines[:1])
    sa.append_jsonl(str(out), lines[1:])  # appended, as swift's JsonlWriter does
    assert [json.loads(x)["response"] for x in out.read_text().splitlines()] == ["A1", None, "A3"]


# ------------------------------------------------------------------------------------------ the docs
def test_docs_table_is_the_flag_table():
    text = (ROOT / "docs" / "ms-swift.md").read_text(encoding="utf-8")
    block = text.split("<!-- swift-flags:start -->\n", 1)[1].split("\n<!-- swift-flags:end -->", 1)[0]
    assert block == sa.markdown_table(), "docs/ms-swift.md: regenerate the table with python -m batch_llm.frontends.swift"
    for f in sa.FLAGS:
        assert f"`--{f.name}`" in block
    assert "[docs/ms-swift.md](docs/ms-swift.md)" in (ROOT / "README.md").read_text(encoding="utf-8")


def test_every_mapped_key_is_a_config_key():
    from batch_llm.config import PipelineConfig

    for f in sa.FLAGS:
        if f.action == sa.MAP and f.key and not f.key.startswith("engine.extra"):
            section, *rest = f.key.split(".")
            model = PipelineConfig.model_fields[section].annotation
            assert rest[0] in model.model_fields, f.key


def test_a_run_in_a_temporary_folder_writes_no_result_cache(tmp_path, capsys):
    """Without --work-dir the run's folder is deleted at the end: a result cache there is work thrown away, so it is
    off; with --work-dir the run is kept, and so is its cache."""
    import yaml
    from batch_llm.frontends.cli import main

    (tmp_path / "rows.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    base = ["infer", "--model", str(tmp_path), "--val_dataset", str(tmp_path / "rows.jsonl"), "--result_path",
            str(tmp_path / "out.jsonl"), "--print-config"]

    def cache_enabled(*extra: str) -> bool:
        capsys.readouterr()
        assert main([*base, *extra]) == 0
        return yaml.safe_load(capsys.readouterr().out)["cache"]["enabled"]

    assert cache_enabled() is False
    assert cache_enabled("--work-dir", str(tmp_path / "work")) is True


# ------------------------------------------------------------------ every field of ms-swift's InferArguments
def _extractor():
    import importlib.util

    spec = importlib.util.spec_from_file_location("swift_infer_fields", ROOT / "scripts" / "swift_infer_fields.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_SAMPLE = {sa._bool: "true", int: "2", float: "0.5", sa._optional_int: "2", sa._json: '{"a": 1}',
           sa._rope: '{"type": "linear", "factor": 2.0}'}


@pytest.mark.parametrize("name", [n for n, _ in swift_fields.INFER_FIELDS])
def test_every_ms_swift_infer_flag_is_honoured_or_refused_with_its_reason(name):
    """Each field of ms-swift's InferArguments is a flag here: given a value, it sets a key, is noted, warned
    about, or refused with its own reason (its row's text), never as a flag batch-llm does not know."""
    flag = sa.BY_NAME[name]
    assert flag.action in (sa.MAP, sa.OWN, sa.NOTE, sa.WARN, sa.REFUSE)
    assert flag.how or flag.action in (sa.MAP, sa.OWN), f"--{name}: say what it becomes or why it is refused"
    try:
        _plan("--infer_backend", "vllm", f"--{name}", _SAMPLE.get(flag.type, "x"))
    except ConfigError as e:
        said = str(e)
        assert "not a flag batch-llm infer knows" not in said and f"--{name}" in said, said
        if flag.action == sa.REFUSE:
            assert flag.how in said


def test_flags_beyond_ms_swift_4_are_older_spellings_and_unknown_ones_stay_errors():
    """The flag table holds ms-swift 4's fields and the older spellings its users' scripts still pass; a flag
    that no ms-swift has is the generic error."""
    fields = {n for n, _ in swift_fields.INFER_FIELDS}
    for f in sa.FLAGS:
        assert f.name in fields or "spelling" in f.how, f.name
    with pytest.raises(ConfigError, match="--no_such_flag: not a flag batch-llm infer knows"):
        _plan("--no_such_flag", "1")


def test_the_shipped_field_list_is_the_extractors_output():
    """swift_fields.py is what scripts/swift_infer_fields.py renders (regenerated, not edited by hand)."""
    text = (ROOT / "include" / "batch_llm" / "frontends" / "swift_fields.py").read_text(encoding="utf-8")
    assert text == _extractor().render(swift_fields.MS_SWIFT_VERSION, list(swift_fields.INFER_FIELDS))
    assert swift_fields.MS_SWIFT_VERSION == "4.6.0"


def test_the_extractor_follows_bases_across_modules_in_dataclass_order(tmp_path):
    """Fields come from the class and its bases found in other modules, a base's first (MRO reversed), a name
    redeclared keeping its first place; private and ClassVar names are no flags."""
    pkg = tmp_path / "swift"
    (pkg / "arguments" / "base_args").mkdir(parents=True)
    (pkg / "rlhf").mkdir()
    (pkg / "version.py").write_text("__version__ = '9.9.9'\n")
    (pkg / "rlhf" / "mixin.py").write_text("class VllmArguments:\n    vllm_a: int = 1\n    _hidden: int = 0\n")
    (pkg / "arguments" / "base_args" / "base.py").write_text(
        "class ModelArguments:\n    model: str = None\n    seed: int = 1\n"
        "class BaseArguments(ModelArguments):\n    seed: int = 42\n    adapters: list = None\n"
        "    table: ClassVar[dict] = {}\n")
    (pkg / "arguments" / "infer_args.py").write_text(
        "from swift.rlhf.mixin import VllmArguments\n"
        "class InferArguments(VllmArguments, BaseArguments):\n    result_path: str = None\n    def f(self): x: int = 1\n")
    text = _extractor().extract(tmp_path)
    namespace: dict = {}
    exec(text, namespace)
    assert namespace["MS_SWIFT_VERSION"] == "9.9.9"
    assert namespace["INFER_FIELDS"] == (("model", "ModelArguments"), ("seed", "ModelArguments"),
                                         ("adapters", "BaseArguments"), ("vllm_a", "VllmArguments"),
                                         ("result_path", "InferArguments"))


@pytest.mark.skipif(not os.environ.get("MS_SWIFT_SOURCE"), reason="MS_SWIFT_SOURCE: an ms-swift wheel or source "
                    "folder (pip download --no-deps ms-swift==4.6.0) to check swift_fields.py against")
def test_the_shipped_field_list_matches_ms_swift():
    """swift_fields.py holds what the extractor reads from the ms-swift release it names."""
    text = _extractor().extract(Path(os.environ["MS_SWIFT_SOURCE"]))
    assert text == (ROOT / "include" / "batch_llm" / "frontends" / "swift_fields.py").read_text(encoding="utf-8")


def test_ckpt_dir_is_the_adapter_or_the_model(tmp_path):
    """swift 2.x's --ckpt_dir: a LoRA checkpoint is --adapters, a full one --model."""
    lora = tmp_path / "lora"
    lora.mkdir()
    (lora / "adapter_config.json").write_text("{}")
    plan = _plan("--ckpt_dir", str(lora))
    assert plan.overrides["model.lora"] == {"ref": str(lora), "merge": True}
    full = sa.plan_invocation(sa.parse_swift_args(["--ckpt_dir", str(tmp_path), "--val_dataset", "r.jsonl",
                                                   "--result_path", "o.jsonl"]))
    assert full.overrides["model.ref"] == str(tmp_path) and "model.lora" not in full.overrides


def test_pixels_rope_and_model_kwargs_reach_the_engine(tmp_path):
    """--max_pixels and --model_kwargs' MAX_PIXELS / MIN_PIXELS are the image processor's settings; --rope_scaling
    (its JSON object) is laid over the model's config through vLLM's hf_overrides."""
    rope = '{"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}'
    plan = _plan("--infer_backend", "vllm", "--max_pixels", "1003520", "--rope_scaling", rope,
                 "--model_kwargs", '{"min_pixels": 3136}')
    cfg = sa.build_config(plan, tmp_path)
    assert cfg.engine.mm_processor_kwargs == {"max_pixels": 1003520, "min_pixels": 3136}
    assert cfg.engine.extra["hf_overrides"] == {"rope_scaling": json.loads(rope)}
    with pytest.raises(ConfigError, match="--rope_scaling: 'yarn': a JSON object"):
        _plan("--infer_backend", "vllm", "--rope_scaling", "yarn")
    with pytest.raises(ConfigError, match="--rope_scaling: .*the transformers engine takes none"):
        _plan("--infer_backend", "pt", "--rope_scaling", rope)
    with pytest.raises(ConfigError, match="--model_kwargs FPS_MAX_FRAMES: swift sets it as the environment"):
        _plan("--model_kwargs", '{"FPS_MAX_FRAMES": 8}')


@pytest.mark.parametrize("words, quantize", [
    (["--quant_method", "bnb", "--quant_bits", "4"], {"enabled": True, "scheme": "W4A16", "method": "rtn"}),
    (["--quant_method", "hqq", "--quant_bits", "4"], {"enabled": True, "scheme": "W4A16", "method": "rtn"}),
    (["--quant_method", "fp8"], {"enabled": True, "scheme": "FP8_DYNAMIC"}),
])
def test_load_time_quantization_is_the_quantize_stage(words, quantize):
    """swift's quantization at load is the quantize stage's export (int4 round-to-nearest, or FP8)."""
    over = _plan("--infer_backend", "vllm", *words).overrides
    assert {k.split(".", 1)[1]: v for k, v in over.items() if k.startswith("quantize.")} == quantize


@pytest.mark.parametrize("words, named", [
    (["--quant_method", "bnb", "--quant_bits", "8"], "--quant_method bnb --quant_bits 8: batch-llm's quantize stage"),
    (["--quant_bits", "4"], "--quant_bits 4: needs --quant_method"),
    (["--truncation_strategy", "left"], "--truncation_strategy left: not supported by batch-llm infer: delete"),
    (["--response_prefix", "<think>"], "batch-llm has no assistant prefix"),
    (["--task_type", "embedding"], "engine.task: embed or classify"),
])
def test_flags_without_a_counterpart_are_refused_with_why(words, named):
    with pytest.raises(ConfigError) as e:
        _plan(*words)
    assert named in str(e.value)


def test_truncation_strategy_delete_is_what_batch_llm_does():
    """delete (swift's default): an over-long prompt is the row's error line here, so it is accepted."""
    plan = _plan("--truncation_strategy", "delete", "--tuner_type", "lora", "--task_type", "causal_lm")
    assert plan.warnings == [] and plan.overrides == _plan().overrides
