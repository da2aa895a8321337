"""Inspect kvoffload's values in a Redis/Valkey server (or cluster), read-only.

Keys are :mod:`kvoffload.tiers.redis_client`'s:
``kvoffload:v1:<namespace digest hex>:<key hex>:r<rank>``, and one record per
namespace (``kvoffload:v1:<namespace digest hex>:namespace``,
:mod:`kvoffload.tiers.redis_record`: the namespace's fields, read with ``GET``).
Only read commands are
sent: ``SCAN`` with a ``MATCH`` pattern and a ``COUNT`` (never ``KEYS``, which blocks
the server), then, pipelined in batches, ``STRLEN`` and ``GETRANGE`` of the header
(or, with ``--verify``, ``GET`` of the whole value), and ``INFO memory`` for the
server's ``maxmemory`` and ``maxmemory-policy``. Nothing is written or deleted: the
engine deletes bad values itself when it reads them.

The server evicts while we look: a key listed by ``SCAN`` but gone when fetched
counts as *vanished* (without ``--verify`` an empty value counts so too, since
``STRLEN`` cannot tell them apart). ``SCAN`` may list a key twice; it is counted once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

from kvoffload.core.chunk_format import HEADER_BYTES
from kvoffload.core.errors import ConfigError, UsageError
from kvoffload.core.identity.namespace_record import decode_record
from kvoffload.core.keys import ChunkKey
from kvoffload.core.secrets import redact_url
from kvoffload.inspection.checks import check_stored
from kvoffload.inspection.model import (
    MAX_RANK,
    FirstNames,
    NamespaceTally,
    Report,
    is_digest_hex,
)
from kvoffload.tiers.redis_client import (
    LazyCluster,
    RedisSettings,
    key_name,
    make_client,
    namespace_pattern,
)
from kvoffload.tiers.redis_record import record_key

SCAN_COUNT = 1000
HEADER_BATCH = 512  # keys per pipeline for STRLEN + GETRANGE
VALUE_BATCH = 32  # keys per pipeline for GET (values may be megabytes each)
RECOMMENDED_POLICY = "allkeys-lru"

_Share = tuple[str, NamespaceTally, ChunkKey, int]


def inspect_redis(
    url: str,
    *,
    namespace: str | None,
    verify: bool,
    world_size: int | None,
    cluster: bool = False,
    username: str | None = None,
    password: str | None = None,
    timeout_ms: int = 2000,
) -> Report:
    """What the server at ``url`` (``redis://`` or ``rediss://``, as the tier accepts
    it) holds under kvoffload's prefix: every namespace, or only ``namespace``. An
    empty namespace is reported with zero counts (the server may have evicted it).

    Raises :class:`UsageError` for a bad URL, a missing ``redis`` package, and any
    server error (unreachable, refused credentials, timeout), as one line that never
    shows the password.
    """
    if not url.startswith(("redis://", "rediss://")):
        raise UsageError(f"{redact_url(url)!r} is not a redis:// or rediss:// URL")
    try:
        import redis
    except ImportError:
        raise UsageError("the redis package is missing: pip install 'kvoffload[redis]'") from None
    where = redact_url(url)
    settings = RedisSettings(url, cluster, timeout_ms, username, password, pool_size=2)
    try:
        client = make_client(settings)
    except (ConfigError, ValueError) as exc:  # redis-py: ValueError for a bad query option
        detail = f" ({exc})" if isinstance(exc, ValueError) else ""
        raise UsageError(f"{where} is not a valid Redis URL{detail}") from None
    try:
        server, warnings = server_memory(client, cluster)
        tallies, stray, recorded = _scan(client, namespace, verify)
        records = _records(client, recorded)
    except redis.RedisError as exc:
        detail = " ".join(str(exc).split()) or type(exc).__name__
        raise UsageError(f"Redis at {where}: {detail}") from None
    with contextlib.suppress(redis.RedisError):
        if isinstance(client, LazyCluster):
            client.close()
        else:
            client.connection_pool.disconnect()
    return Report(
        tier="redis",
        location=where,
        verified=verify,
        namespaces=[tallies[d].report(world_size, records.get(d)) for d in sorted(tallies)],
        stray=stray.count,
        stray_examples=[name for name, _ in stray.first()],
        server=server,
        warnings=warnings,
    )


def server_memory(client: Any, cluster: bool) -> tuple[dict[str, str | int], list[str]]:
    """``maxmemory`` (bytes, summed over a cluster's primaries), ``maxmemory_policy``
    (distinct values, comma-separated) and ``used_memory``; and warnings when the
    server will not evict kvoffload's values. A server that refuses ``INFO`` (ACL) is
    reported as unknown with a warning; connection errors propagate."""
    import redis

    nodes = client.get_primaries() if cluster else [None]
    infos: list[dict[str, Any]] = []
    try:
        for node in nodes:
            options = {"target_nodes": node} if node is not None else {}
            infos.append(client.info("memory", **options))
    except redis.ResponseError as exc:
        text = " ".join(str(exc).split())
        return {"maxmemory_policy": "unknown"}, [
            f"could not read the server's memory settings ({text}); "
            f"make sure maxmemory is set and maxmemory-policy is {RECOMMENDED_POLICY}"
        ]
    policies = sorted({str(info.get("maxmemory_policy", "unknown")) for info in infos})
    limits = [int(info.get("maxmemory", 0)) for info in infos]
    server: dict[str, str | int] = {
        "nodes": len(infos),
        "maxmemory": sum(limits),
        "maxmemory_policy": ",".join(policies),
        "used_memory": sum(int(info.get("used_memory", 0)) for info in infos),
    }
    warnings = []
    if any(not p.startswith("allkeys-") for p in policies):
        warnings.append(
            f"maxmemory-policy is {server['maxmemory_policy']}: kvoffload sets no expiry "
            "and relies on the server evicting its values, so a volatile-* policy never "
            "evicts them and noeviction makes writes fail once memory is full; "
            f"use {RECOMMENDED_POLICY}"
        )
    if any(limit == 0 for limit in limits):
        warnings.append(
            "maxmemory is 0 (no limit): the server never evicts and kvoffload's values "
            "grow until the machine runs out of memory; set maxmemory"
        )
    return server, warnings


def parse_key_name(name: str) -> tuple[str, ChunkKey, int] | None:
    """``(namespace digest hex, key, rank)`` of a share's key name, exactly as the
    tier writes it; None for any other name."""
    parts = name.split(":")
    if len(parts) != 5 or not (is_digest_hex(parts[2]) and is_digest_hex(parts[3])):
        return None
    rank = parts[4][1:]
    if not (rank.isascii() and rank.isdigit()) or int(rank) > MAX_RANK:
        return None
    key = ChunkKey(bytes.fromhex(parts[3]))
    if key_name(bytes.fromhex(parts[2]), key, int(rank)) != name:
        return None
    return parts[2], key, int(rank)


def parse_record_name(name: str) -> str | None:
    """The namespace digest hex of a namespace record's key name, exactly as the
    engine writes it (:func:`~kvoffload.tiers.redis_record.record_key`); None for
    any other name."""
    parts = name.split(":")
    if len(parts) != 4 or not is_digest_hex(parts[2]):
        return None
    return parts[2] if record_key(bytes.fromhex(parts[2])) == name else None


def _scan(
    client: Any, namespace: str | None, verify: bool
) -> tuple[dict[str, NamespaceTally], FirstNames, list[str]]:
    """Every namespace's tally, the stray names, and the namespaces whose record key
    was listed."""
    tallies: dict[str, NamespaceTally] = {}
    recorded: set[str] = set()
    if namespace is not None:
        tallies[namespace] = NamespaceTally(namespace, verify)
    stray = FirstNames()
    strays_seen: set[str] = set()
    pattern = namespace_pattern(bytes.fromhex(namespace) if namespace else None)
    limit = VALUE_BATCH if verify else HEADER_BATCH
    batch: list[_Share] = []
    pending: set[str] = set()
    for raw in client.scan_iter(match=pattern, count=SCAN_COUNT):
        name = raw.decode("utf-8", "backslashreplace") if isinstance(raw, bytes) else str(raw)
        record_of = parse_record_name(name)
        if record_of is not None:
            tallies.setdefault(record_of, NamespaceTally(record_of, verify))
            recorded.add(record_of)
            continue
        parsed = parse_key_name(name)
        if parsed is None:
            if name not in strays_seen:
                strays_seen.add(name)
                stray.add(name)
            continue
        digest_hex, key, rank = parsed
        tally = tallies.setdefault(digest_hex, NamespaceTally(digest_hex, verify))
        if name in pending or tally.seen(key, rank):
            continue
        batch.append((name, tally, key, rank))
        pending.add(name)
        if len(batch) >= limit:
            _fetch(client, batch, verify)
            batch, pending = [], set()
    _fetch(client, batch, verify)
    return tallies, stray, sorted(recorded)


def _records(client: Any, digests: list[str]) -> dict[str, dict[str, str]]:
    """The valid records of ``digests`` (one pipelined ``GET`` each, per batch); a
    record gone or bad meanwhile is left out. Connection errors propagate."""
    import redis

    out: dict[str, dict[str, str]] = {}
    for start in range(0, len(digests), HEADER_BATCH):
        batch = digests[start : start + HEADER_BATCH]
        pipe = client.pipeline(transaction=False)
        for digest_hex in batch:
            pipe.get(record_key(bytes.fromhex(digest_hex)))
        for digest_hex, value in zip(batch, pipe.execute(raise_on_error=False), strict=True):
            if isinstance(value, Exception) and not isinstance(value, redis.ResponseError):
                raise value
            if isinstance(value, (bytes, str)):
                fields = decode_record(value, digest_hex)
                if fields is not None:
                    out[digest_hex] = fields
    return out


def _fetch(client: Any, batch: list[_Share], verify: bool) -> None:
    """Fetch and tally one batch in one pipelined round trip (per node, in a cluster)."""
    if not batch:
        return
    import redis

    pipe = client.pipeline(transaction=False)
    for name, *_ in batch:
        if verify:
            pipe.get(name)
        else:
            pipe.strlen(name)
            pipe.getrange(name, 0, HEADER_BYTES - 1)
    results = pipe.execute(raise_on_error=False)
    for result in results:
        if isinstance(result, Exception) and not isinstance(result, redis.ResponseError):
            raise result  # the connection failed: the whole inspection fails
    step = 1 if verify else 2
    for (name, tally, key, rank), answer in zip(batch, _groups(results, step), strict=True):
        first = answer[0]
        if isinstance(first, redis.ResponseError):  # WRONGTYPE: not a string value
            text = " ".join(str(first).split())
            wrong = ("type", f"not a string value ({text})")
            tally.add(key, rank, name, size=0, header=None, failure=wrong)
        elif not verify:
            if first == 0:
                tally.add_vanished()
            else:
                tally.add(key, rank, name, size=int(first), header=bytes(answer[1]), failure=None)
        elif first is None:
            tally.add_vanished()
        else:
            error = check_stored(first, bytes.fromhex(tally.digest_hex), key, rank)
            failure = None if error is None else (error.reason.value, str(error))
            tally.add(
                key, rank, name, size=len(first), header=first[:HEADER_BYTES], failure=failure
            )


def _groups(results: list[Any], step: int) -> Iterable[list[Any]]:
    return (results[i : i + step] for i in range(0, len(results), step))
