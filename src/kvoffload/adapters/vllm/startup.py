"""What kvoffload says when an engine starts: one summary line per role, and a
warning for each tier that starts degraded.

The scheduler role (one per engine) prints the tiers and their capacity in chunks,
the chunk size, the policies and the load-failure policy it set; each worker prints
its rank, the KV layout it registered, its host slab and the copy path. Warnings:
a Redis password given inline (it is in vLLM's log and the process list), a Redis
server that does not answer at start (the tier misses until it does), a disk tier
that asked for O_DIRECT on a filesystem that refuses it, the numpy copy path where
the compiled kernel is missing. :func:`record_namespace` writes a namespace's record
for ``kvoffload inspect`` and logs a failure.

Contract: these functions only read the objects they are given and log; a probe of
Redis (and the record's one ``SET``) waits at most ``redis_timeout_ms``; nothing here
raises.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from kvoffload.core.config import OffloadConfig
from kvoffload.core.keys import Namespace
from kvoffload.core.secrets import redact_url
from kvoffload.inspection.render import human_bytes as size

logger = logging.getLogger("kvoffload")


def password_source(config: OffloadConfig) -> str:
    if config.redis_password_file is not None:
        return "password from redis_password_file"
    if config.redis_password_env is not None:
        return f"password from ${config.redis_password_env}"
    if config.inline_secret() is not None:
        return "password inline"
    return "no password"


def warn_inline_secret(config: OffloadConfig) -> None:
    where = config.inline_secret()
    if where is not None:
        logger.warning(
            "kvoffload: the Redis password is given inline (%s); vLLM prints "
            "kv_connector_extra_config in its start-up log and the command line is visible "
            "to ps. Put it in a file (redis_password_file) or an environment variable "
            "(redis_password_env) instead.",
            where,
        )


def scheduler_summary(
    config: OffloadConfig,
    *,
    chunk_tokens: int,
    chunk_bytes: int,
    world_size: int,
    host_chunks: int,
    disk_chunks: int,
    load_failure_policy: str,
) -> str:
    """The scheduler role's one start-up line (``chunk_bytes``: all ranks together)."""
    tiers = [f"host {size(config.cpu_bytes)} = {host_chunks} chunks ({config.eviction})"]
    if config.disk_path is not None and config.disk_bytes is not None:
        tiers.append(
            f"disk {config.disk_path} {size(config.disk_bytes)} = {disk_chunks} chunks"
            + (" O_DIRECT" if config.disk_o_direct else "")
        )
    if config.redis_url is not None:
        kind = "redis cluster" if config.redis_cluster else "redis"
        tiers.append(f"{kind} {redact_url(config.redis_url)} ({password_source(config)})")
    admission = config.lower_tier_admission
    parts = [
        "kvoffload: on (scheduler)",
        f"chunk {chunk_tokens} tokens = {size(chunk_bytes)}"
        + (f" over {world_size} ranks" if world_size > 1 else ""),
        "tiers: " + "; ".join(tiers),
        f"store after {config.store_threshold} lookup(s)",
    ]
    if len(tiers) > 1:
        parts.append(
            "lower tiers: write-through"
            if admission == "write_through"
            else f"lower tiers: after {admission} host hits"
        )
    parts.append(f"kv_load_failure_policy={load_failure_policy}")
    if config.metrics_port is not None:
        parts.append(f"metrics http://127.0.0.1:{config.metrics_port}/metrics")
    return ", ".join(parts)


def worker_summary(
    *,
    rank: int,
    world_size: int,
    layers: int,
    device: str,
    slab_bytes: int,
    slots: int,
    copy_path: str,
    tiers: list[str],
) -> str:
    """A worker's one start-up line."""
    return (
        f"kvoffload: on (worker rank {rank} of {world_size}): {layers} KV layers on "
        f"{device}, host slab {size(slab_bytes)} = {slots} chunks, copies: {copy_path}, "
        f"tiers below host: {', '.join(tiers) if tiers else 'none'}"
    )


def probe_redis(client: Any, config: OffloadConfig) -> None:
    """Warn when the Redis server does not answer a PING now."""
    try:
        client.ping()
    except Exception as exc:
        logger.warning(
            "kvoffload: Redis at %s does not answer (%s: %s); the Redis tier misses until it does",
            redact_url(config.redis_url or ""),
            type(exc).__name__,
            " ".join(str(exc).split())[:200],
        )


def record_namespace(
    tier: str, write: Callable[[Any, Namespace], object], where: Any, namespace: Namespace
) -> None:
    """Write ``namespace``'s record (``tiers/namespace_records.py``) with ``write``
    into ``where`` (a disk root, a Redis client); a failure is logged, never raised:
    the record only serves ``kvoffload inspect``."""
    try:
        write(where, namespace)
    except Exception as exc:
        logger.warning(
            "kvoffload: could not record namespace %s in the %s tier (%s: %s); "
            "kvoffload inspect will show its fields as unknown",
            namespace.digest().hex(),
            tier,
            type(exc).__name__,
            " ".join(str(exc).split())[:200],
        )
