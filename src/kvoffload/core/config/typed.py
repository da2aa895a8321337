"""User configuration: one definition per option, validated at start-up.

Every option is declared once in :data:`OPTIONS` (``core/config/options.py``: name,
type, default, accepted values, meaning; each lower tier's options in its own module,
``tiers/<tier>_tier.py``); :meth:`OffloadConfig.from_dict`
validates a raw mapping (the vLLM ``kv_connector_extra_config``) against it, and
the docs' option table is generated from the same list, so the two cannot drift.
Unknown keys and invalid values raise :class:`~kvoffload.core.errors.ConfigError`
naming the key and the accepted values.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from kvoffload.core.config.options import OPTIONS, SECTIONS, Option, default
from kvoffload.core.errors import ConfigError
from kvoffload.core.secrets import HIDDEN, redact_url, url_has_password

__all__ = ["OPTIONS", "OffloadConfig", "Option", "shown_value"]

_BY_NAME = {o.name: o for o in OPTIONS}
_TIER_OPTIONS = {o.name: o for section in SECTIONS for o in section.options}


def shown_value(name: str, value: Any) -> str:
    """``value`` as kvoffload may print it: secrets hidden, URL passwords redacted."""
    option = _BY_NAME.get(name)
    if option is not None and option.secret and value is not None:
        return HIDDEN
    if option is not None and option.url and isinstance(value, str):
        return repr(redact_url(value))
    return repr(value)


def _check(option: Option, value: Any) -> None:
    if not option.check(value):
        shown = shown_value(option.name, value)
        raise ConfigError(option.name, f"invalid value {shown}; accepted: {option.accepted}")


@dataclass(frozen=True)
class OffloadConfig:
    """Validated kvoffload settings (see :data:`OPTIONS` for each option's meaning).

    Each field's default is the option's declared one (:func:`.options.default`).
    The lower tiers' options (each tier's config section, ``tiers/registry.py``) are
    in ``tier_options``, every one of them with its default filled in; read one with
    :meth:`option` (``config.disk_path`` reads it too, for callers outside kvoffload's
    sources)."""

    cpu_bytes: int
    chunk_tokens: int | None = default("chunk_tokens")
    eviction: str = default("eviction")
    store_threshold: int = default("store_threshold")
    copy_threads: int = default("copy_threads")
    tier_threads: int = default("tier_threads")
    host_share: str | None = default("host_share")
    host_share_timeout_ms: float = default("host_share_timeout_ms")
    share_announce_ms: float = default("share_announce_ms")
    host_share_root: str = default("host_share_root")
    host_share_group: str | int | None = default("host_share_group")
    tier_io_timeout_ms: int = default("tier_io_timeout_ms")
    lower_tier_admission: str | int = default("lower_tier_admission")
    codec: str = default("codec")
    host_codec: str | None = default("host_codec")
    lower_tier_loads: str = default("lower_tier_loads")
    load_policy: str = default("load_policy")
    prefill_tokens_per_s: float = default("prefill_tokens_per_s")
    seal_key_file: str | None = default("seal_key_file")
    seal_required: bool = default("seal_required")
    metrics_port: int | None = default("metrics_port")
    max_deferral_steps: int = default("max_deferral_steps")
    max_deferral_seconds: float = default("max_deferral_seconds")
    tier_options: Mapping[str, Any] = field(default_factory=dict, hash=False, repr=False)

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name != "tier_options":
                _check(_BY_NAME[f.name], getattr(self, f.name))
        unknown = sorted(set(self.tier_options) - set(_TIER_OPTIONS))
        if unknown:
            raise ConfigError(unknown[0], "unknown tier option")
        values = {name: self.tier_options.get(name, o.default) for name, o in _TIER_OPTIONS.items()}
        for name, option in _TIER_OPTIONS.items():
            _check(option, values[name])
        for section in SECTIONS:
            section.check(values)
        object.__setattr__(self, "tier_options", values)

    def option(self, name: str) -> Any:
        """The value of option ``name`` (a tier's or kvoffload's own)."""
        if name in _TIER_OPTIONS:
            return self.tier_options[name]
        if name in _BY_NAME:
            return getattr(self, name)
        raise ConfigError(name, "unknown option")

    def __getattr__(self, name: str) -> Any:
        # Only for names no field has: a tier option read as an attribute.
        if name in _TIER_OPTIONS:
            return self.__dict__.get("tier_options", {}).get(name, _TIER_OPTIONS[name].default)
        raise AttributeError(name)

    def __repr__(self) -> str:
        shown = ", ".join(f"{o.name}={shown_value(o.name, self.option(o.name))}" for o in OPTIONS)
        return f"OffloadConfig({shown})"

    def inline_secret(self) -> str | None:
        """The option that carries a password inline (a secret option, or a password
        inside a URL option), or None."""
        for option in OPTIONS:
            if option.secret and self.option(option.name) is not None:
                return option.name
        for option in OPTIONS:
            value = self.option(option.name)
            if option.url and isinstance(value, str) and url_has_password(value):
                return option.name
        return None

    def tier_codec(self, tier: str) -> str:
        """Tier ``tier``'s codec: its ``<tier>_codec`` option, else ``codec``."""
        name = f"{tier}_codec"
        value = self.option(name) if name in _BY_NAME or name in _TIER_OPTIONS else None
        return str(value) if value is not None else self.codec

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
        tier = {k: raw[k] for k in raw if k in _TIER_OPTIONS}
        own = {k: raw[k] for k in raw if k not in _TIER_OPTIONS}
        return cls(**own, tier_options=tier)

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
