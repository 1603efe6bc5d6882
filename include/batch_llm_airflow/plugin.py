"""The batch-llm Airflow plugin: run reports in the Airflow UI, and the OpenAI Batch API.

- ``fastapi_apps``: the report app (``report_app.py``) at ``/batch-llm``: ``/batch-llm/report?path=<url>``
  serves a published version's ``report.html`` from object storage to signed-in users who may read the
  pipeline's DAG; ``/batch-llm/`` lists recent reports.
- ``fastapi_apps``: the OpenAI Batch API (``openai_app.py``) at ``/openai``: ``/openai/v1/files`` and
  ``/openai/v1/batches`` for OpenAI's clients (``base_url=<Airflow>/openai/v1``, an Airflow token as api_key).
- ``external_views``: "Batch LLM reports" in the UI's navigation (Browse), the list above inside the UI.

The "Run report" button of the publish task (``RunReportLink``) is not registered here: it is declared once,
on ``PublishOperator.operator_extra_links`` (Airflow 3 computes the link when the task finishes and keeps it in
XCom), and listed in the provider info's ``extra-links`` (``get_provider_info.py``).

Airflow finds this class through the ``airflow.plugins`` entry point of the installed distribution
(``pyproject.toml``); ``plugins/batch_llm_plugin.py`` stands in only where that entry point is missing. The
plugin loads in each Airflow process, task processes included; this module imports nothing heavy (the FastAPI
app is built on its first request).
"""
from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from batch_llm_airflow import openai_app, report_app
from batch_llm_airflow.lazy_app import LazyApp


class BatchLlmPlugin(AirflowPlugin):
    name = "batch_llm"
    fastapi_apps = [{"app": LazyApp(report_app.create_app), "url_prefix": report_app.URL_PREFIX,
                     "name": "batch-llm reports"},
                    {"app": LazyApp(openai_app.create_app), "url_prefix": openai_app.URL_PREFIX,
                     "name": "batch-llm OpenAI Batch API"}]
    external_views = [{"name": "Batch LLM reports", "href": f"{report_app.URL_PREFIX}/", "url_route": "batch-llm-reports",
                       "destination": "nav", "category": "browse"}]
