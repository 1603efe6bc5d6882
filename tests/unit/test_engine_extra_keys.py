"""``engine.extra`` keys are checked when the config loads, against the engine's own argument list read from its
installed source (vLLM's EngineArgs and LLM, SGLang's ServerArgs), with the closest argument suggested; where the
engine is not installed the keys are said to be unchecked, not silently accepted. ``sampling.chat_template_kwargs``
keys are checked against the variables the chat template reads (jinja2's analysis), at load where the template is
known and at fetch otherwise. No engine is started or imported."""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
from batch_llm.config import ConfigError, engine_args
from batch_llm.frontends.cli import main
from helpers import DEMO_YAML, demo_config

TEMPLATE = ("{% for m in messages %}{{ m.content }}{% endfor %}{% if enable_thinking is defined and "
            "enable_thinking is false %}/no_think{% endif %}{% if add_generation_prompt %}>{% endif %}")


@pytest.fixture(autouse=True)
def _fresh_argument_lists():
    engine_args.engine_arg_names.cache_clear()
    yield
    engine_args.engine_arg_names.cache_clear()


def test_a_vllm_extra_key_is_checked_against_engine_args_at_load(tmp_path):
    pytest.importorskip("vllm")  # only its source is read
    names = engine_args.engine_arg_names("vllm")
    assert names is not None and {"max_num_batched_tokens", "hf_overrides", "compilation_config",
                                  "kv_cache_memory_bytes", "async_scheduling", "max_logprobs"} <= names
    cfg = demo_config(tmp_path, engine__extra={"max_num_batched_tokens": 4096, "max_logprobs": 30})
    assert cfg.engine.extra["max_num_batched_tokens"] == 4096
    with pytest.raises(ConfigError, match=r"engine.extra.max_num_batched_token: not an argument vLLM takes .*did you "
                                          r"mean 'max_num_batched_tokens'\?"):
        demo_config(tmp_path, engine__extra={"max_num_batched_token": 4096})


def test_a_typo_in_the_pipeline_file_is_refused_by_validate_naming_file_and_key(tmp_path, capsys):
    pytest.importorskip("vllm")
    text = DEMO_YAML.read_text(encoding="utf-8").replace("engine:\n", "engine:\n  extra: {enforce_eagr: true}\n", 1)
    assert "enforce_eagr" in text
    path = DEMO_YAML.parent / f".{tmp_path.name}.yaml"  # beside the demo: its relative paths still resolve
    path.write_text(text, encoding="utf-8")
    try:
        assert main(["validate", str(path)]) == 1
    finally:
        path.unlink()
    err = capsys.readouterr().err
    assert f"{path}: engine: " in err and "engine.extra.enforce_eagr" in err and "'enforce_eager'" in err, err


def _fake_sglang(root: Path) -> None:
    pkg = root / "sglang"
    (pkg / "srt").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "srt" / "__init__.py").write_text("")
    (pkg / "srt" / "server_args.py").write_text(
        "import dataclasses\n\n\n@dataclasses.dataclass\nclass ServerArgs:\n    model_path: str\n"
        "    ep_size: int = 1\n    schedule_policy: str = 'fcfs'\n")


def test_sglang_extra_keys_are_checked_against_server_args_where_installed(tmp_path, monkeypatch):
    _fake_sglang(tmp_path / "site")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert engine_args.engine_arg_names("sglang") == {"model_path", "ep_size", "schedule_policy"}
    cfg = demo_config(tmp_path, engine__kind="sglang", engine__extra={"ep_size": 2})
    assert cfg.engine.extra == {"ep_size": 2}
    with pytest.raises(ConfigError, match=r"engine.extra.schedule_polcy: not an argument SGLang takes \(the installed "
                                          r"ServerArgs\); did you mean 'schedule_policy'\?"):
        demo_config(tmp_path, engine__kind="sglang", engine__extra={"schedule_polcy": "lpm"})


def test_where_the_engine_is_not_installed_the_keys_are_said_to_be_unchecked(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(engine_args, "_package_dir", lambda package: None)
    with pytest.warns(engine_args.EngineArgsUnchecked, match=r"engine.extra \(ep_size\): not checked: sglang is not "
                                                             r"installed here"):
        cfg = demo_config(tmp_path, engine__kind="sglang", engine__extra={"ep_size": 2})
    assert cfg.engine.extra == {"ep_size": 2}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no extra keys: nothing to say
        demo_config(tmp_path, engine__kind="sglang")
    assert main(["validate", str(DEMO_YAML), "--set", "engine.extra={max_num_seqs_x: 1}"]) == 0
    assert "warning: engine.extra (max_num_seqs_x): not checked: vllm is not installed here" in capsys.readouterr().err


def test_chat_template_kwargs_keys_are_the_templates_variables_at_load(tmp_path):
    cfg = demo_config(tmp_path, model__chat_template=TEMPLATE, sampling__chat_template_kwargs={"enable_thinking": False})
    assert cfg.sampling.chat_template_kwargs == {"enable_thinking": False}
    with pytest.raises(ConfigError, match=r"sampling.chat_template_kwargs.enable_thinkng: the chat template "
                                          r"\(model.chat_template\) has no variable 'enable_thinkng'.*the template's "
                                          r"variables: add_generation_prompt, enable_thinking, messages"):
        demo_config(tmp_path, model__chat_template=TEMPLATE, sampling__chat_template_kwargs={"enable_thinkng": False})
    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    with pytest.raises(ConfigError, match=rf"chat_template_kwargs.lang: the chat template \(the model's, at {model}\)"):
        demo_config(tmp_path, model__ref=str(model), sampling__chat_template_kwargs={"lang": "fr"})


def test_chat_template_kwargs_of_a_model_fetched_later_are_checked_at_fetch(tmp_path):
    """A ModelScope id: its template is known once fetched; the fetch stage's check refuses the key then."""
    from batch_llm.stages.infer.identity import reasoning_problems

    cfg = demo_config(tmp_path, sampling__chat_template_kwargs={"enable_thinkng": False})  # not known at load
    model = tmp_path / "fetched"
    model.mkdir()
    (model / "chat_template.jinja").write_text(TEMPLATE)
    problems = reasoning_problems(cfg, str(model))
    assert any(p.startswith("sampling.chat_template_kwargs.enable_thinkng: the chat template (the model's, at ")
               for p in problems), problems
    ok = demo_config(tmp_path, sampling__chat_template_kwargs={"enable_thinking": False})
    assert reasoning_problems(ok, str(model)) == []
