"""Eviction policies, registered by name.

``make_policy(name, capacity)`` builds one; an unknown name raises
:class:`~kvoffload.core.errors.ConfigError` listing the valid names.
``register_policy`` adds an out-of-tree policy class.
"""

from __future__ import annotations

from kvoffload.core.errors import ConfigError
from kvoffload.core.policies.arc import ARCPolicy
from kvoffload.core.policies.base import Evictable, EvictionPolicy
from kvoffload.core.policies.lru import LRUPolicy
from kvoffload.core.policies.s3fifo import S3FIFOPolicy
from kvoffload.core.policies.slru import SLRUPolicy

_REGISTRY: dict[str, type[EvictionPolicy]] = {
    cls.name: cls for cls in (LRUPolicy, ARCPolicy, S3FIFOPolicy, SLRUPolicy)
}


def policy_names() -> list[str]:
    """Names accepted by :func:`make_policy`, sorted."""
    return sorted(_REGISTRY)


def register_policy(cls: type[EvictionPolicy]) -> None:
    """Make ``cls`` available under ``cls.name``; re-registering a name replaces it."""
    _REGISTRY[cls.name] = cls


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    """Build the policy registered as ``name`` for ``capacity`` chunks."""
    cls = _REGISTRY.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ConfigError(
            "eviction", f"unknown policy {name!r}; valid: {', '.join(policy_names())}"
        )
    return cls(capacity)


__all__ = [
    "ARCPolicy",
    "Evictable",
    "EvictionPolicy",
    "LRUPolicy",
    "S3FIFOPolicy",
    "SLRUPolicy",
    "make_policy",
    "policy_names",
    "register_policy",
]
