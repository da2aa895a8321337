"""Storage tiers: host memory (:mod:`kvoffload.tiers.host`), then disk and Redis.

Deliberately imports nothing, so that using one tier never imports another tier's
dependencies (torch for the host tier, a client library for Redis).
"""
