"""User configuration: one definition per option, validated at start-up.

Every option is declared once in :data:`OPTIONS` (``config_options.py``: name,
type, default, accepted values, meaning); :meth:`OffloadConfig.from_dict`
validates a raw mapping (the vLLM ``kv_connector_extra_config``) against it, and
the docs' option table is generated from the same list, so the two cannot drift.
Unknown keys and invalid values raise :class:`~kvoffload.core.errors.ConfigError`
naming the key and the accepted values.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from kvoffload.core.config_options import OPTIONS, Option
from kvoffload.core.errors import ConfigError
from kvoffload.core.secrets import (
    HIDDEN,
    read_secret_env,
    read_secret_file,
    redact_url,
    url_has_password,
)

SECRET_OPTIONS = frozenset({"redis_password"})

__all__ = ["OPTIONS", "OffloadConfig", "Option", "shown_value"]

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
    tier_io_timeout_ms: int = 5000
    redis_username: str | None = None
    redis_password_file: str | None = None
    redis_password_env: str | None = None
    redis_password: str | None = field(default=None, repr=False)
    lower_tier_admission: str | int = "write_through"
    lower_tier_loads: str = "direct"
    load_policy: str = "cost"
    prefill_tokens_per_s: float = 10000.0
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
