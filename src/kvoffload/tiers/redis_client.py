"""Redis / Valkey connections and key names for kvoffload's shared tier.

redis-py speaks both. ``redis://`` or ``rediss://`` (TLS) URLs, credentials in the
URL or given separately, a single node or a Redis Cluster, a bounded connection
pool (callers wait for a free connection rather than opening more), and a timeout
on every operation (``timeout_ms``, also for connecting) so a slow or dead server
fails a job instead of stalling it.

Key of one rank's share of a chunk: ``kvoffload:v1:<namespace digest>:<key>:r<rank>``
(hex), so the namespace prefixes every key and ``SCAN kvoffload:v1:<digest>:*``
lists one namespace.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlparse

from kvoffload.core.errors import ConfigError
from kvoffload.core.keys import ChunkKey
from kvoffload.core.secrets import redact_url

PREFIX = "kvoffload:v1"


@dataclass(frozen=True)
class RedisSettings:
    url: str
    cluster: bool = False
    timeout_ms: int = 1000
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    pool_size: int = 8

    def __repr__(self) -> str:
        return (
            f"RedisSettings(url={redact_url(self.url)!r}, cluster={self.cluster}, "
            f"timeout_ms={self.timeout_ms}, username={self.username!r}, "
            f"password={'***' if self.password is not None else None}, "
            f"pool_size={self.pool_size})"
        )


def key_name(namespace_digest: bytes, key: ChunkKey, rank: int) -> str:
    return f"{PREFIX}:{namespace_digest.hex()}:{key.hex()}:r{rank}"


def namespace_pattern(namespace_digest: bytes | None) -> str:
    return f"{PREFIX}:{namespace_digest.hex() if namespace_digest else '*'}:*"


def make_client(settings: RedisSettings) -> Any:
    """A redis-py client (``Redis``, or a lazily connecting ``RedisCluster``).

    Never connects here: a server that is down at start makes operations fail (the
    tier misses), not the engine. ``username`` / ``password`` given separately
    override the URL's. A URL that cannot be parsed raises :class:`ConfigError`
    naming ``redis_url``.
    """
    import redis

    if settings.cluster:
        _split_credentials(settings)  # validate now, connect later
        return LazyCluster(settings)
    url, kwargs = _split_credentials(settings)
    pool = redis.BlockingConnectionPool.from_url(
        url, max_connections=settings.pool_size, timeout=settings.timeout_ms / 1000, **kwargs
    )
    return redis.Redis(connection_pool=pool)


def _split_credentials(settings: RedisSettings) -> tuple[str, dict[str, Any]]:
    """The URL without credentials, and the connection keywords: timeouts and the
    credentials (the separate settings win over the URL's)."""
    try:
        url = urlparse(settings.url)
        port = url.port
        if not url.hostname:
            raise ValueError("no host")
    except ValueError as exc:
        shown = redact_url(settings.url)
        raise ConfigError("redis_url", f"invalid value {shown!r}: {exc}") from None
    timeout = settings.timeout_ms / 1000
    kwargs: dict[str, Any] = {
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
    }
    username = settings.username if settings.username is not None else url.username
    password = settings.password if settings.password is not None else url.password
    if username:
        kwargs["username"] = unquote(username) if settings.username is None else username
    if password is not None:
        kwargs["password"] = unquote(password) if settings.password is None else password
    netloc = url.hostname if ":" not in url.hostname else f"[{url.hostname}]"
    if port is not None:
        netloc += f":{port}"
    return url._replace(netloc=netloc).geturl(), kwargs


def zero_copy(client: Any) -> bool:
    """Whether chunk values can take kvoffload's own path
    (:mod:`kvoffload.tiers.redis_reader`) on ``client``'s pooled connections: a
    single-node client, not the cluster client."""
    return not isinstance(client, LazyCluster) and hasattr(client, "connection_pool")


class LazyCluster:
    """A ``RedisCluster`` created on first use (its constructor asks the cluster for
    its slot map, which fails while the cluster is down). Until creation succeeds
    every use raises ``redis.ConnectionError`` and the next use tries again.
    Thread-safe; attribute access is forwarded to the cluster client."""

    def __init__(self, settings: RedisSettings) -> None:
        self._settings = settings
        self._client: Any = None
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._connect(), name)

    def _connect(self) -> Any:
        with self._lock:
            if self._client is None:
                import redis
                from redis.cluster import RedisCluster

                try:
                    url, kwargs = _split_credentials(self._settings)
                    self._client = RedisCluster.from_url(
                        url, max_connections=self._settings.pool_size, **kwargs
                    )
                except redis.RedisError:
                    raise
                except Exception as exc:  # redis-py raises plain errors for no nodes
                    raise redis.ConnectionError(f"Redis Cluster unreachable: {exc}") from exc
            return self._client
