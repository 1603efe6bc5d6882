"""``python -m batch_llm``: the ``batch-llm`` command."""
from batch_llm.frontends.cli import main

raise SystemExit(main())
