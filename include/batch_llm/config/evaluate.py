"""The ``evaluate`` section: the scored sample of rows and the quality gate, its metric spelled as EvalScope does
(``metric_names.py``)."""
from __future__ import annotations

from pydantic import Field, field_validator

from batch_llm.config.section import Section


class EvaluateConfig(Section):
    enabled: bool = True
    sample_rows: int | None = Field(2000, gt=0, description="Score a deterministic sample of this many rows "
                                    "with references (null scores every row)")
    sample_seed: int = Field(0, description="Seed of the sample: the same seed picks the same rows")
    min_score: float | None = Field(None, description="Fail the run when the metric falls below this")
    metric: str = Field("Rouge-L-F", description="EvalScope metric that min_score applies to (any case or "
                        "separators: rouge-l-f, rouge_l_f; stored as EvalScope spells it)")

    @field_validator("metric")
    @classmethod
    def _known_metric(cls, v: str) -> str:
        # A name the gate would not find makes min_score a silent no-op: refused here, spelled as EvalScope does.
        from batch_llm.config.metric_names import canonical_metric

        return canonical_metric(v)
