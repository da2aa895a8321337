"""One configuration option, and a section of them: how a value is checked and what
it means (:class:`Option`), and a group of options one part of kvoffload owns with
its check across them (:class:`ConfigSection`: each lower tier declares one, see
:mod:`kvoffload.tiers.spec`).

Pure data and predicates; nothing here raises except a section's ``check``, which
raises :class:`~kvoffload.core.errors.ConfigError` naming the option.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

Check = Callable[[Any], bool]


@dataclass(frozen=True)
class Option:
    """One configuration key: how to check it and what it means. ``secret``: never
    printed (shown hidden); ``url``: printed with any password in it redacted."""

    name: str
    accepted: str  # human description of the accepted values
    default: Any
    doc: str
    check: Check
    required: bool = False
    secret: bool = False
    url: bool = False


def _no_check(values: Mapping[str, Any]) -> None:
    return None


@dataclass(frozen=True)
class ConfigSection:
    """The options one part of kvoffload owns (a tier's), and ``check``: the rule
    across them, given every option's value by name (raises ``ConfigError``)."""

    options: tuple[Option, ...]
    check: Callable[[Mapping[str, Any]], None] = _no_check


def int_at_least(low: int) -> Check:
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= low


def positive_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def non_negative_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


def optional(check: Check) -> Check:
    """``check``, or unset (None)."""
    return lambda v: v is None or check(v)


def is_bool(v: Any) -> bool:
    return isinstance(v, bool)


def non_empty_text(v: Any) -> bool:
    return isinstance(v, str) and bool(v)


class OptionValues(Protocol):
    """What a part of kvoffload reads of the configuration through its options
    (:class:`~kvoffload.core.config.typed.OffloadConfig` is one): an option's value by name,
    and which option carries a password inline (None: none)."""

    def option(self, name: str) -> Any: ...

    def inline_secret(self) -> str | None: ...
