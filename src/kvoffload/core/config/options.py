"""Every user option of kvoffload, declared once: name, accepted values, default,
meaning and the check of a value (:data:`OPTIONS`): kvoffload's own
(:mod:`.own_options`) and each lower tier's config section (``tiers/registry.py``).

:mod:`kvoffload.core.config.typed` validates a raw mapping against this list and the docs'
option table is generated from it (``python -m kvoffload.docgen``), so the two cannot
drift. Every other place that needs an option's default (a dataclass field, a
command-line default, a value derived from it such as a timeout in seconds) reads it
with :func:`default` (here, or :func:`.own_options.default` in a module the tiers
import), so each default is written once, in its declaration. Pure data; nothing here
raises except :func:`option` and :func:`default` for an unknown name.
"""

from __future__ import annotations

from typing import Any

from kvoffload.core.config.own_options import HEAD, SHARE, TAIL
from kvoffload.core.config.sections import Check, ConfigSection, Option
from kvoffload.core.errors import ConfigError
from kvoffload.tiers.registry import TIERS

__all__ = ["OPTIONS", "SECTIONS", "Check", "ConfigSection", "Option", "default", "option"]


SECTIONS: tuple[ConfigSection, ...] = tuple(spec.section for spec in TIERS)
"""Each lower tier's config section (``tiers/registry.py``), in the tiers' order."""

OPTIONS: tuple[Option, ...] = (
    *HEAD,
    *SHARE,
    *(option for section in SECTIONS for option in section.options),
    *TAIL,
)

_BY_NAME: dict[str, Option] = {o.name: o for o in OPTIONS}


def option(name: str) -> Option:
    """The declared option ``name`` (kvoffload's own or a tier's); ``ConfigError``
    naming ``name`` and the known options when there is no such option."""
    found = _BY_NAME.get(name)
    if found is None:
        raise ConfigError(name, f"unknown option; options: {', '.join(sorted(_BY_NAME))}")
    return found


def default(name: str) -> Any:
    """The declared default of option ``name`` (None: unset, or required).
    ``ConfigError`` for an unknown name, as :func:`option`."""
    return option(name).default
