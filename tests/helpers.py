"""Small helpers shared by the tests."""
from __future__ import annotations

from pathlib import Path

from batch_llm.config import PipelineConfig, load_config

ROOT = Path(__file__).resolve().parents[1]
DEMO_YAML = ROOT / "dags" / "pipelines" / "demo.yaml"


def demo_config(tmp: Path, **overrides) -> PipelineConfig:
    """The demo pipeline writing under ``tmp``; overrides are dotted keys with '__' for '.'."""
    cfg = load_config(DEMO_YAML)
    return cfg.with_overrides({"output.path": str(tmp / "out"), **{k.replace("__", "."): v
                                                                   for k, v in overrides.items()}})
