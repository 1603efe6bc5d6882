"""batch_llm: the stage library."""
