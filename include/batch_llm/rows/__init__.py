"""What a row of a run is, above the config and below the file formats.

- ``params``: a row's own sampling parameters (an OpenAI Batch request body's fields, or a table's columns) over the
  pipeline's ``sampling`` section, checked against the engine's capability row
"""

__all__ = ["params"]
