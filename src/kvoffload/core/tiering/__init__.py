"""Where chunks go below the engine: the scheduler half's view of the tiers.

- :mod:`.lower`: a lower tier as the scheduler half books it (:class:`~.lower.LowerTier`,
  the interface; :class:`~.lower.DirectoryTier`, one over a directory) and the
  ordered set of them;
- :mod:`.planning`: which chunks spill, promote or load from which tier (the tier
  planner the scheduler half's stores and lookups call);
- :mod:`.routes`: a transfer job's legs, by :class:`~.routes.Medium` (engine, host
  memory, a lower tier by name), for the worker backends to dispatch.

Pure Python: no torch, no vLLM.
"""
