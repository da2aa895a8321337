"""What a lower tier holds: the machinery behind ``kvoffload inspect``.

:mod:`.model` holds the per-namespace tally and the integrity check of one stored
share, :mod:`.disk_scan` and :mod:`.redis_scan` walk a disk tier directory and a
Redis/Valkey keyspace, :mod:`.render` prints the result as a table or JSON. Every
function here only reads: nothing is created, changed or deleted in the tier.
"""
