"""What a lower tier holds: the machinery behind ``kvoffload inspect``.

:mod:`.model` holds the report and the per-namespace tally, :mod:`.checks` the
integrity check of one stored share, :mod:`.groups` the chunks' KV cache groups;
:mod:`.disk_scan` and :mod:`.redis_scan` walk a disk tier directory and a
Redis/Valkey keyspace, :mod:`.render` prints the result as a table or JSON.
:mod:`.metrics_fetch` reads a running engine's metrics endpoint, :mod:`.exposition`
parses the Prometheus text, :mod:`.tier_health` turns kvoffload's counters into the
tiers' health and :mod:`.health_render` prints it. Every function here only reads:
nothing is created, changed or deleted in the tier or the engine.
"""
