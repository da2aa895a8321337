"""User configuration: one definition per option, validated at start-up.

Every option is declared once in :data:`OPTIONS` (name, type, default, accepted
values, meaning); :meth:`OffloadConfig.from_dict` validates a raw mapping (the vLLM
``kv_connector_extra_config``) against it, and the docs' option table is generated
from the same list, so the two cannot drift. Unknown keys and invalid values raise
:class:`~kvoffload.core.errors.ConfigError` naming the key and the accepted values.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from kvoffload.core.errors import ConfigError
from kvoffload.core.policies import policy_names
from kvoffload.core.secrets import (
    HIDDEN,
    read_secret_env,
    read_secret_file,
    redact_url,
    url_has_password,
)

SECRET_OPTIONS = frozenset({"redis_password"})

Check = Callable[[Any], bool]


@dataclass(frozen=True)
class Option:
    """One configuration key: how to check it and what it means."""

    name: str
    accepted: str  # human description of the accepted values
    default: Any
    doc: str
    check: Check
    required: bool = False


def _int_at_least(low: int) -> Check:
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= low


def _positive_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def _policy(v: Any) -> bool:
    return isinstance(v, str) and v in policy_names()


OPTIONS: tuple[Option, ...] = (
    Option(
        "cpu_bytes",
        "integer >= 1",
        None,
        "Host memory for offloaded chunks, in bytes, for all workers together.",
        _int_at_least(1),
        required=True,
    ),
    Option(
        "chunk_tokens",
        "positive multiple of the engine block size",
        None,
        "Tokens per chunk (the unit stored, loaded and evicted). Default: the engine block size.",
        lambda v: v is None or _int_at_least(1)(v),
    ),
    Option(
        "eviction",
        " | ".join(policy_names()),
        "lru",
        "Eviction policy of the host tier.",
        _policy,
    ),
    Option(
        "store_threshold",
        "integer >= 1",
        1,
        "Store a chunk only after this many requests looked it up (1 stores everything).",
        _int_at_least(1),
    ),
    Option(
        "copy_threads",
        "integer >= 1",
        1,
        "CPU threads per worker copying KV between engine and host memory when the KV "
        "cache is in host memory (CPU engines). 2 nearly doubles copy bandwidth but shares "
        "cores with the model.",
        _int_at_least(1),
    ),
    Option(
        "tier_threads",
        "integer >= 1",
        4,
        "Threads per worker moving chunks between host memory and the disk and Redis "
        "tiers. More keep more disk requests and Redis round trips in flight; on a small "
        "machine sharing cores with a local Redis server, fewer can be faster.",
        _int_at_least(1),
    ),
    Option(
        "disk_path",
        "a directory path (created owner-only if missing)",
        None,
        "Enables the local-disk tier below host memory, with chunk files under this "
        "directory. Needs disk_bytes.",
        lambda v: v is None or (isinstance(v, str) and bool(v)),
    ),
    Option(
        "disk_bytes",
        "integer >= 1",
        None,
        "Capacity of the disk tier in bytes, all workers together; the least valuable "
        "chunks are evicted (by the eviction policy) beyond it.",
        lambda v: v is None or _int_at_least(1)(v),
    ),
    Option(
        "disk_o_direct",
        "true | false",
        False,
        "Read and write chunk files with O_DIRECT (bypass the page cache).",
        lambda v: isinstance(v, bool),
    ),
    Option(
        "redis_url",
        "redis://[user:password@]host:port[/db] or rediss://... (TLS)",
        None,
        "Enables the shared Redis/Valkey tier. Capacity and eviction are the server's "
        "(set maxmemory and maxmemory-policy allkeys-lru).",
        lambda v: v is None or (isinstance(v, str) and v.startswith(("redis://", "rediss://"))),
    ),
    Option(
        "redis_cluster",
        "true | false",
        False,
        "redis_url names a node of a Redis Cluster.",
        lambda v: isinstance(v, bool),
    ),
    Option(
        "redis_timeout_ms",
        "integer >= 1",
        1000,
        "Timeout of every Redis operation, connecting included; a slower server fails "
        "the operation (a miss), it never stalls the engine.",
        _int_at_least(1),
    ),
    Option(
        "redis_username",
        "string",
        None,
        "Redis username (overrides the URL's).",
        lambda v: v is None or isinstance(v, str),
    ),
    Option(
        "redis_password_file",
        "a file path",
        None,
        "Read the Redis password from this file (its text without the final line "
        "break; make it readable by the serving user only). The way to give a password: "
        "it never appears in vLLM's start-up log or the process list. Overrides the URL's.",
        lambda v: v is None or (isinstance(v, str) and bool(v)),
    ),
    Option(
        "redis_password_env",
        "an environment variable name",
        None,
        "Read the Redis password from this environment variable of the serving "
        "process. Overrides the URL's.",
        lambda v: v is None or (isinstance(v, str) and bool(v) and "=" not in v),
    ),
    Option(
        "redis_password",
        "string",
        None,
        "Redis password given inline (overrides the URL's). Discouraged: vLLM logs "
        "kv_connector_extra_config at start-up and the command line is visible to ps; "
        "kvoffload warns once. Use redis_password_file or redis_password_env.",
        lambda v: v is None or isinstance(v, str),
    ),
    Option(
        "lower_tier_admission",
        '"write_through" or an integer N >= 1',
        "write_through",
        "When a chunk is written below host memory: as soon as its host store completes "
        "(write_through), or after it was loaded from host memory N times.",
        lambda v: v == "write_through" or _int_at_least(1)(v),
    ),
    Option(
        "metrics_port",
        "integer 1..65535",
        None,
        "Serve kvoffload's Prometheus metrics on http://127.0.0.1:<port>/metrics from the "
        "scheduler process (vLLM's own /metrics carries them too when stats are on).",
        lambda v: v is None or (_int_at_least(1)(v) and v <= 65535),
    ),
    Option(
        "max_deferral_steps",
        "integer >= 1",
        500,
        "A request deferred (transfers in flight, promotion, lower-tier lookup) for this "
        "many busy engine steps (steps that ran other requests; idle steps do not count) "
        "is admitted without a hit and recomputes.",
        _int_at_least(1),
    ),
    Option(
        "max_deferral_seconds",
        "number > 0",
        5.0,
        "Same bound in seconds; whichever is reached first applies.",
        _positive_number,
    ),
)

_BY_NAME = {o.name: o for o in OPTIONS}


def shown_value(name: str, value: Any) -> str:
    """``value`` as kvoffload may print it: secrets hidden, URL passwords redacted."""
    if name in SECRET_OPTIONS and value is not None:
        return HIDDEN
    if name == "redis_url" and isinstance(value, str):
        return repr(redact_url(value))
    return repr(value)


@dataclass(frozen=True)
class OffloadConfig:
    """Validated kvoffload settings (see :data:`OPTIONS` for each field's meaning)."""

    cpu_bytes: int
    chunk_tokens: int | None = None
    eviction: str = "lru"
    store_threshold: int = 1
    copy_threads: int = 1
    tier_threads: int = 4
    disk_path: str | None = None
    disk_bytes: int | None = None
    disk_o_direct: bool = False
    redis_url: str | None = None
    redis_cluster: bool = False
    redis_timeout_ms: int = 1000
    redis_username: str | None = None
    redis_password_file: str | None = None
    redis_password_env: str | None = None
    redis_password: str | None = field(default=None, repr=False)
    lower_tier_admission: str | int = "write_through"
    metrics_port: int | None = None
    max_deferral_steps: int = 500
    max_deferral_seconds: float = 5.0

    def __post_init__(self) -> None:
        for f in fields(self):
            option = _BY_NAME[f.name]
            value = getattr(self, f.name)
            if not option.check(value):
                shown = shown_value(f.name, value)
                raise ConfigError(f.name, f"invalid value {shown}; accepted: {option.accepted}")
        if (self.disk_path is None) != (self.disk_bytes is None):
            missing = "disk_bytes" if self.disk_bytes is None else "disk_path"
            raise ConfigError(missing, "disk_path and disk_bytes go together")
        given = [
            name
            for name in ("redis_password_file", "redis_password_env", "redis_password")
            if getattr(self, name) is not None
        ]
        if len(given) > 1:
            raise ConfigError(given[1], f"give the Redis password one way, not also {given[0]}")
        if given and self.redis_url is None:
            raise ConfigError(given[0], "needs redis_url")

    def __repr__(self) -> str:
        shown = ", ".join(
            f"{f.name}={shown_value(f.name, getattr(self, f.name))}" for f in fields(self)
        )
        return f"OffloadConfig({shown})"

    def redis_password_resolved(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The Redis password from ``redis_password_file``, ``redis_password_env`` or
        ``redis_password`` (whichever is set; None: the URL's own, if any). Reads the
        file or the environment now; raises :class:`ConfigError` naming the option
        when it cannot."""
        if self.redis_password_file is not None:
            return read_secret_file("redis_password_file", self.redis_password_file)
        if self.redis_password_env is not None:
            env = os.environ if environ is None else environ
            return read_secret_env("redis_password_env", self.redis_password_env, env)
        return self.redis_password

    def inline_secret(self) -> str | None:
        """The option that carries a password inline (``redis_password``, or a password
        inside ``redis_url``), or None."""
        if self.redis_password is not None:
            return "redis_password"
        if self.redis_url is not None and url_has_password(self.redis_url):
            return "redis_url"
        return None

    @property
    def spill_after_hits(self) -> int:
        """0: write-through; N: after N host hits (see ``lower_tier_admission``)."""
        admission = self.lower_tier_admission
        return 0 if admission == "write_through" else int(admission)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> OffloadConfig:
        """Validate ``raw`` (e.g. ``kv_connector_extra_config``) into a config."""
        if not isinstance(raw, Mapping):
            raise ConfigError("kv_connector_extra_config", f"must be a mapping, got {raw!r}")
        unknown = sorted(set(raw) - set(_BY_NAME))
        if unknown:
            raise ConfigError(unknown[0], f"unknown key; valid keys: {', '.join(sorted(_BY_NAME))}")
        for option in OPTIONS:
            if option.required and option.name not in raw:
                raise ConfigError(option.name, f"is required ({option.accepted})")
        return cls(**{k: raw[k] for k in raw})

    def resolve_chunk_tokens(self, block_size: int) -> int:
        """``chunk_tokens`` checked against the engine's block size (default: one block)."""
        chunk = block_size if self.chunk_tokens is None else self.chunk_tokens
        if chunk % block_size:
            raise ConfigError(
                "chunk_tokens",
                f"invalid value {chunk!r}; accepted: a positive multiple of the engine "
                f"block size {block_size}",
            )
        return chunk
