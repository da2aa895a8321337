"""What an engine tells about kvoffload: metrics, anomalies and cache events.

- :mod:`.metrics`: the metric series and their declarations;
- :mod:`.recorder`: the scheduler half's recorder (counters, gauges, observations);
- :mod:`.metrics_view`: one consistent reading of them;
- :mod:`.anomalies`: conditions counted and logged once;
- :mod:`.events`: which chunks a tier gained or lost (turned into vLLM's KV events
  by the adapter).

Pure Python: no torch, no vLLM.
"""
