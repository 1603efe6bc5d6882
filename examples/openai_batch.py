"""A batch job written for OpenAI's Batch API, as OpenAI's guide writes one: upload a JSONL file of requests,
create a batch, poll it, download the output and error files.

It runs unchanged against a batch-llm Airflow deployment, on its own GPUs, but for two settings the ``openai``
client reads from the environment:

    export OPENAI_BASE_URL=https://airflow.example.com/openai/v1     # the Airflow API server's /openai/v1
    export OPENAI_API_KEY=$(curl -s -X POST https://airflow.example.com/auth/token \\
        -H 'Content-Type: application/json' -d '{"username": "...", "password": "..."}' | jq -r .access_token)
    python examples/openai_batch.py [requests.jsonl]

The deployment serves the model names its pipelines list under ``openai_batch.models`` (docs/openai-batch-api.md).
tests/system/test_openai_batch_api.py runs this file against real Airflow services.
"""
import json
import sys
import time

from openai import OpenAI

client = OpenAI()

if len(sys.argv) > 1:
    path = sys.argv[1]
else:
    path = "batchinput.jsonl"
    questions = ["What is the capital of France?", "Name a primary color.", "What is 2 + 2?"]
    with open(path, "w") as f:
        for i, q in enumerate(questions):
            f.write(json.dumps({"custom_id": f"request-{i + 1}", "method": "POST", "url": "/v1/chat/completions",
                                "body": {"model": "gpt-4o-mini", "max_tokens": 16,
                                         "messages": [{"role": "system", "content": "You are a helpful assistant."},
                                                      {"role": "user", "content": q}]}}) + "\n")

batch_input_file = client.files.create(file=open(path, "rb"), purpose="batch")
batch = client.batches.create(input_file_id=batch_input_file.id, endpoint="/v1/chat/completions",
                              completion_window="24h", metadata={"description": "nightly eval job"})
print(f"created {batch.id} ({batch.status})")

while batch.status not in ("completed", "failed", "expired", "cancelled"):
    time.sleep(2)
    batch = client.batches.retrieve(batch.id)
    counts = batch.request_counts
    print(f"{batch.status}: {counts.completed} completed, {counts.failed} failed of {counts.total}")

if batch.status != "completed":
    sys.exit(f"batch {batch.id} {batch.status}: {batch.errors}")
for line in client.files.content(batch.output_file_id).text.splitlines():
    result = json.loads(line)
    print(result["custom_id"], "->", result["response"]["body"]["choices"][0]["message"]["content"])
if batch.error_file_id:
    print(client.files.content(batch.error_file_id).text)
