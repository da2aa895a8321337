"""``kvoffload simulate``: capacity planning by replaying a workload.

A workload (a JSONL trace, :mod:`kvoffload.simulate.trace`, or the built-in chat
generator, :mod:`kvoffload.simulate.chat`) runs through the reference engine's batch
former and block pool with a null model (:mod:`kvoffload.simulate.engine`), driving
the real scheduler half, chunk directories, eviction policies and tier planner
(:mod:`kvoffload.simulate.runner`). Transfers take the time a cost model gives them
(:mod:`kvoffload.simulate.cost`, :mod:`kvoffload.simulate.worker`). The command is
:mod:`kvoffload.simulate.command`; ``docs/simulate.md`` is the user's guide.
"""
