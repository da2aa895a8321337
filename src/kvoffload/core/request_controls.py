"""Per-request controls: what one request lets kvoffload do with its KV.

A request carries them in vLLM's per-request ``kv_transfer_params`` (the OpenAI API
takes ``kv_transfer_params`` in the request body), under the key ``kvoffload`` so
they never collide with another connector's parameters::

    "kv_transfer_params": {"kvoffload": {"store": false}}              # private data
    "kv_transfer_params": {"kvoffload": {"max_load_tokens": 4096,
                                         "load_tiers": ["host", "disk"]}}

================  ==========================  ===========================================
field             accepted                    meaning
================  ==========================  ===========================================
store             true | false                false: never store this request's KV
load              true | false | "always"     false: never serve it stored KV;
                  | "cost"                    "always": load every hit (load_policy
                                              always for this request); "cost": only
                                              what beats recomputing (load_policy cost)
max_store_tokens  integer >= 0                store only chunks within its first N tokens
max_load_tokens   integer >= 0                serve only chunks within its first N tokens
load_tiers        list of host, disk, redis   the lower tiers a hit may be read from
                                              (host memory always serves what it holds)
================  ==========================  ===========================================

Contract: :func:`parse_controls` never raises. Anything it cannot take (the
``kvoffload`` value not a mapping, an unknown field, a wrong type) makes the request
be served without offloading (neither stored nor loaded) and names the offending
field, for the caller to warn about and count. Parameters without a ``kvoffload``
key (or other connectors' keys beside it) are the defaults.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvoffload.tiers.registry import tier_names

PARAMS_KEY = "kvoffload"
TIER_NAMES = tier_names()  # host memory, then every lower tier of the registry


@dataclass(frozen=True)
class RequestControls:
    store: bool = True
    load: bool = True
    max_store_tokens: int | None = None
    max_load_tokens: int | None = None
    load_tiers: frozenset[str] | None = None  # None: every tier
    load_policy: str | None = None  # "always" | "cost"; None: the configured load_policy

    def store_chunks(self, chunk_tokens: int) -> int | None:
        """How many leading chunks may be stored (None: no limit)."""
        if not self.store:
            return 0
        return None if self.max_store_tokens is None else self.max_store_tokens // chunk_tokens

    def load_chunks(self, chunk_tokens: int) -> int | None:
        """How many leading chunks may be served (None: no limit)."""
        if not self.load:
            return 0
        return None if self.max_load_tokens is None else self.max_load_tokens // chunk_tokens

    def may_promote_from(self, tier: str) -> bool:
        return self.load_tiers is None or tier in self.load_tiers


DEFAULT = RequestControls()
OFF = RequestControls(store=False, load=False)


def _flag(value: Any) -> bool | None:
    return value if isinstance(value, bool) else None


LOAD_POLICIES = ("always", "cost")


def _load(value: Any) -> bool | str | None:
    """``load``: a flag, or a load policy (which loads)."""
    if isinstance(value, bool):
        return value
    return value if isinstance(value, str) and value in LOAD_POLICIES else None


def _tokens(value: Any) -> int | None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
    return value if ok else None


def _tiers(value: Any) -> frozenset[str] | None:
    if not isinstance(value, list | tuple) or not all(v in TIER_NAMES for v in value):
        return None
    return frozenset(value)


_FIELDS: dict[str, Any] = {
    "store": _flag,
    "load": _load,
    "max_store_tokens": _tokens,
    "max_load_tokens": _tokens,
    "load_tiers": _tiers,
}


def parse_controls(params: Any) -> tuple[RequestControls, str | None]:
    """The controls in a request's ``kv_transfer_params``, and the field that was
    refused (``kvoffload.<field>``; then the controls are :data:`OFF`), or None."""
    if params is None:
        return DEFAULT, None
    if not isinstance(params, Mapping):
        return OFF, "kv_transfer_params"
    raw = params.get(PARAMS_KEY)
    if raw is None:
        return DEFAULT, None
    if not isinstance(raw, Mapping):
        return OFF, PARAMS_KEY
    values: dict[str, Any] = {}
    for name, value in raw.items():
        check = _FIELDS.get(name) if isinstance(name, str) else None
        if check is None:
            return OFF, f"{PARAMS_KEY}.{name}"
        parsed = check(value)
        if parsed is None:
            return OFF, f"{PARAMS_KEY}.{name}"
        if isinstance(parsed, str):  # load: a policy
            values["load_policy"] = parsed
            parsed = True
        values[name] = parsed
    return RequestControls(**values), None
