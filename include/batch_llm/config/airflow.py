"""The ``airflow`` section: the DAG's schedule, retries, pool and queue, plain values the provider reads (nothing
here imports Airflow)."""
from __future__ import annotations

from pydantic import Field

from batch_llm.config.section import Section


class AirflowConfig(Section):
    schedule: str | None = None
    start_date: str = "2026-01-01"
    catchup: bool = False
    retries: int = Field(2, ge=0)
    retry_delay_seconds: int = Field(30, ge=0)
    gpu_pool: str = "gpu"
    gpu_queue: str = "gpu"
    tags: list[str] = Field(default_factory=list)
    execution_timeout_minutes: int | None = Field(None, gt=0)
