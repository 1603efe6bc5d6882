"""What a run did, read back from its manifests: statistics, diagnosis, the HTML report, metrics.

- ``run_stats``: throughput, tokens, rows and times per stage and shard
- ``timeline``: the run's phases on one clock (for the report's timeline)
- ``doctor``: findings and advice (what slowed a run, what failed, what to change)
- ``report``: the self-contained ``report.html`` of a run and the index of runs (``templates/``)
- ``metrics_push``: a shard's metrics pushed to a Prometheus Pushgateway
"""

__all__ = ["doctor", "metrics_push", "report", "run_stats", "timeline"]
