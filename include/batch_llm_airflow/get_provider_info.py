"""What Airflow's ProvidersManager reads about this distribution (entry point ``apache_airflow_provider`` in
``pyproject.toml``): ``airflow providers list`` shows it, ``airflow providers links`` lists its extra link.

Modelled on apache/airflow's generated ``get_provider_info.py`` files (the runtime schema is
``airflow/provider_info.schema.json``: ``name`` and ``description`` required, more keys allowed) and on
third-party providers such as astro-provider-ray (``versions``). ``package-name`` must be the distribution's
name as pip knows it, or Airflow refuses the provider.

- ``hooks``: ``batch_llm_airflow.hooks`` (``BatchLlmStorageHook``: storage options and ``conn@bucket`` locations
  for every operator and the report app, with credentials that botocore refreshes). No ``connection-types``:
  the hook reads the amazon provider's ``aws`` connections (``conn_type = "aws"``) and adds no type of its own;
  ProvidersManager keeps one hook per connection type, so a second ``aws`` entry would be dropped as a duplicate
  (or, loaded first, take the amazon provider's form away).
- No ``plugins``: Airflow loads a provider's ``plugins`` only with ``[core] lazy_discover_providers = False``
  (default True), so the UI plugin is registered through the ``airflow.plugins`` entry point, which every
  plugins manager reads. Listing it here too would, in that setting, register ``batch_llm`` a second time:
  Airflow 3.3's plugins manager skips it ("Plugin 'batch_llm' already registered, skipping") and reports that
  as a plugin import error. tests/system/test_provider_wheel.py checks both settings. (apache/airflow's
  openlineage provider lists its plugin both ways; this one does not.)
- ``task-decorators``: ``@task.gpu_llm_batch`` (``batch_llm_airflow.llm_batch``), named apart from common-ai's
  ``@task.llm_batch`` so that both providers can be installed in one Airflow (a name is one decorator).
- ``extra-links``: ``RunReportLink``, whose one registration is ``PublishOperator.operator_extra_links``
  (the plugin no longer lists it); Airflow 3 only shows this list (``airflow providers links``).

Imports nothing beyond the standard library: Airflow calls this in every process that discovers providers.
"""
from __future__ import annotations

from typing import Any

PACKAGE = "batch-llm"
PLUGIN_ENTRY_POINT = "batch_llm_airflow.plugin:BatchLlmPlugin"  # [project.entry-points."airflow.plugins"]
RUN_REPORT_LINK = "batch_llm_airflow.operators.RunReportLink"
GPU_LLM_BATCH_DECORATOR = "batch_llm_airflow.llm_batch.gpu_llm_batch_task"  # @task.gpu_llm_batch
HOOKS_MODULE = "batch_llm_airflow.hooks"  # BatchLlmStorageHook


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(PACKAGE)
    except PackageNotFoundError:  # imported from a source tree that is not installed
        return "0.0.0"


def get_provider_info() -> dict[str, Any]:
    return {
        "package-name": PACKAGE,
        "name": "Batch LLM",
        "description": "Offline batch LLM inference as Airflow 3 pipelines: fetch model, quantize (AWQ or FP8 export), sharded "
                       "batch inference (vLLM, LMDeploy, transformers), content filter, EvalScope scoring, "
                       "publish with a run report.",
        "versions": [_version()],
        "integrations": [{"integration-name": "Batch LLM", "tags": ["ai", "llm"]}],
        "operators": [{"integration-name": "Batch LLM",
                       "python-modules": ["batch_llm_airflow.operators", "batch_llm_airflow.llm_batch"]}],
        "hooks": [{"integration-name": "Batch LLM", "python-modules": [HOOKS_MODULE]}],
        "task-decorators": [{"name": "gpu_llm_batch", "class-name": GPU_LLM_BATCH_DECORATOR}],
        "extra-links": [RUN_REPORT_LINK],
    }
