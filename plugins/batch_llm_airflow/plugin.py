"""The batch-llm Airflow plugin: run reports in the Airflow UI.

- ``fastapi_apps``: the report app (``report_app.py``) at ``/batch-llm``: ``/batch-llm/report?path=<url>``
  serves a published version's ``report.html`` from object storage to signed-in users who may read the
  pipeline's DAG; ``/batch-llm/`` lists recent reports.
- ``external_views``: "Batch LLM reports" in the UI's navigation (Browse), the list above inside the UI.
- ``operator_extra_links``: the "Run report" button of the publish task (``RunReportLink``, also declared on
  ``PublishOperator``; Airflow 3 computes the link when the task finishes and keeps it in XCom).

Airflow imports every ``.py`` file under ``plugins/`` in each of its processes, task processes included;
this file imports nothing heavy (the FastAPI app is built on its first request).
"""
from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from batch_llm_airflow.operators import RunReportLink
from batch_llm_airflow.report_app import URL_PREFIX, LazyReportApp


class BatchLlmPlugin(AirflowPlugin):
    name = "batch_llm"
    fastapi_apps = [{"app": LazyReportApp(), "url_prefix": URL_PREFIX, "name": "batch-llm reports"}]
    external_views = [{"name": "Batch LLM reports", "href": f"{URL_PREFIX}/", "url_route": "batch-llm-reports",
                       "destination": "nav", "category": "browse"}]
    operator_extra_links = [RunReportLink()]
