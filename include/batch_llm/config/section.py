"""The base of every config section, and the error a configuration that cannot be used raises."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A pipeline configuration that cannot be used; the message names the file and the key."""


class Section(BaseModel):
    # Unknown keys are errors: a typo in a YAML file must not be silently ignored.
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
