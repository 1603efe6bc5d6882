"""The OpenAI Batch API's logic, without Airflow: files and batches in object storage, their limits and checks,
and a batch's status read from its run. ``batch_llm_airflow.openai_app`` serves it in Airflow's API server.

- ``errors``: OpenAI's error shape (``ApiError``)
- ``store``: uploaded files and batch records under one storage root (``BatchStore``), streamed both ways
- ``validate``: the checks of a batch's input file (request count, one model, JSONL) before it runs
- ``status``: the Batch object of a record and its run (status, request_counts, timestamps, files)
- ``stop``: a cancelled or expired batch's shard closed with what it committed, the rest error lines
"""
