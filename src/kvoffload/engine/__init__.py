"""A small deterministic reference engine for tests and simulation.

Not a model server: a paged block pool with a prefix cache, a waiting queue and a
running set, a per-step token budget with chunked prefill, preemption by recompute,
aborts, and synchronous or batch-queue stepping. It drives kvoffload's scheduler half
through the same calls the vLLM adapter makes, and a worker whose jobs complete
only when the caller says so.
"""
