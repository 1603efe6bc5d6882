"""The Airflow layer of batch_llm: thin operators over the stage library, a task group, the DAG factory
and the UI plugin. No stage logic lives here."""
