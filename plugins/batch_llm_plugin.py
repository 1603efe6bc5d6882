"""The batch-llm UI plugin, for an Airflow whose ``batch-llm`` package is importable but not installed as a
distribution (so without its ``airflow.plugins`` entry point).

Where the distribution is installed (the wheel, ``pip install .``, this repository's editable install by
scripts/setup.sh, both images), Airflow loads ``batch_llm_airflow.plugin.BatchLlmPlugin`` through that entry
point: the one mechanism for deployments. This file then defines nothing, and must not: Airflow 3.3's plugins
manager registers the plugins folder first and the entry points after it, and skips a second plugin of a name it
already has ("Plugin 'batch_llm' already registered, skipping"), reporting that as a plugin import error
(``airflow plugins``, the UI's banner). It picks up every AirflowPlugin subclass in this module's namespace,
imported ones included, so the class is imported only when no installed entry point names it (e.g. a
deployment that copies ``batch_llm_airflow`` into its plugins folder instead of installing the wheel).
tests/system/test_provider_wheel.py checks both branches and the installed wheel (one plugin, no import error).
"""
from __future__ import annotations

from importlib.metadata import entry_points

_PLUGIN = "batch_llm_airflow.plugin:BatchLlmPlugin"

if not any(ep.value == _PLUGIN for ep in entry_points(group="airflow.plugins")):
    from batch_llm_airflow.plugin import BatchLlmPlugin  # noqa: F401
