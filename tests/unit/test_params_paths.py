"""The trigger form's ``model_ref`` and ``filter_lists`` may name local paths only under allowed roots: a user
who may trigger runs must not point a worker at any file of the machine."""
from __future__ import annotations

import pytest
from batch_llm.config import ConfigError, load_config
from batch_llm_airflow.params import overrides_from_params, params_for
from helpers import DEMO_YAML


@pytest.fixture
def cfg(monkeypatch):
    monkeypatch.delenv("BATCH_LLM_ALLOWED_LOCAL_ROOTS", raising=False)
    monkeypatch.delenv("AIRFLOW__BATCH_LLM__ALLOWED_LOCAL_ROOTS", raising=False)
    return load_config(DEMO_YAML)


def _form(cfg, **changes) -> dict:
    """The params of a triggered run: the form's defaults (the YAML's values) with ``changes``."""
    return {**{k: p.value for k, p in params_for(cfg).items()}, **changes}


def _models(tmp_path):
    allowed = tmp_path / "models"
    (allowed / "qwen").mkdir(parents=True)
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "key.txt").write_text("k")
    return allowed, secret


def test_the_yaml_values_ids_and_urls_pass(cfg):
    overrides_from_params(_form(cfg), cfg)  # the untouched form: the YAML's own word-list file and model id
    over = overrides_from_params(_form(cfg, model_ref="Qwen/Qwen2.5-0.5B-Instruct",
                                       filter_lists=["mask en builtin:en", "drop s3 s3://bucket/words.txt"]), cfg)
    assert over["model.ref"] == "Qwen/Qwen2.5-0.5B-Instruct"
    assert overrides_from_params(_form(cfg, model_ref="s3://bucket/models/qwen"), cfg)["model.ref"].startswith("s3")


def test_a_local_model_outside_the_roots_is_refused(cfg, tmp_path):
    _, secret = _models(tmp_path)
    with pytest.raises(ConfigError, match=f"model_ref names the local path {secret}.*BATCH_LLM_ALLOWED_LOCAL_ROOTS"):
        overrides_from_params(_form(cfg, model_ref=str(secret)), cfg)
    with pytest.raises(ConfigError, match="filter_lists names the local path"):
        overrides_from_params(_form(cfg, filter_lists=[f"flag k {secret / 'key.txt'}"]), cfg)
    with pytest.raises(ConfigError, match="filter_lists"):  # a list given as an object (the REST API's conf)
        overrides_from_params(_form(cfg, filter_lists=[{"action": "flag", "name": "k", "path": "/etc/passwd"}]), cfg)


def test_paths_under_a_configured_root_pass_and_escapes_do_not(cfg, tmp_path, monkeypatch):
    allowed, secret = _models(tmp_path)
    monkeypatch.setenv("BATCH_LLM_ALLOWED_LOCAL_ROOTS", f"{tmp_path / 'elsewhere'}, {allowed}")
    assert overrides_from_params(_form(cfg, model_ref=str(allowed / "qwen")), cfg)["model.ref"] == str(allowed / "qwen")
    assert overrides_from_params(_form(cfg, model_ref=f"file://{allowed}/qwen"), cfg)
    with pytest.raises(ConfigError, match="model_ref"):  # .. resolved before the check
        overrides_from_params(_form(cfg, model_ref=f"{allowed}/../secret"), cfg)
    (allowed / "link").symlink_to(secret)
    with pytest.raises(ConfigError, match="model_ref"):  # a symlink under a root to a folder outside it
        overrides_from_params(_form(cfg, model_ref=str(allowed / "link")), cfg)
    with pytest.raises(ConfigError, match="filter_lists"):
        overrides_from_params(_form(cfg, filter_lists=[f"flag k {allowed}/link/key.txt"]), cfg)


def test_the_roots_can_come_from_airflow_config(cfg, tmp_path, monkeypatch):
    allowed, secret = _models(tmp_path)
    monkeypatch.setenv("AIRFLOW__BATCH_LLM__ALLOWED_LOCAL_ROOTS", str(allowed))
    assert overrides_from_params(_form(cfg, model_ref=str(allowed / "qwen")), cfg)
    with pytest.raises(ConfigError, match="model_ref"):
        overrides_from_params(_form(cfg, model_ref=str(secret)), cfg)
