"""Which tiers a configuration seals, and what the engine says about it at start
(decision 0024).

A tier is sealed when ``seal_key_file`` is set and its spec's
:attr:`~kvoffload.tiers.spec.TierSpec.seals` says so for the configuration (Redis:
always; the disk tier: with ``disk_seal``). A store other processes or machines reach
(a :attr:`~kvoffload.tiers.spec.Locality.REMOTE` tier) left unsealed is named at start
with what that means; with ``seal_required`` it refuses the start instead. Pure
functions of the configuration and the specs; :func:`settle` reads the key file.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvoffload.core.config.sections import OptionValues
from kvoffload.core.errors import ConfigError
from kvoffload.sealing.keyfile import OPTION, SealKeys
from kvoffload.sealing.layout import SEAL_BYTES
from kvoffload.tiers.spec import Locality, TierSpec


def sealed(config: OptionValues, spec: TierSpec[Any, Any]) -> bool:
    """Whether ``config`` seals tier ``spec``'s chunks."""
    return config.option(OPTION) is not None and spec.seals(config)


def stored_bytes(config: OptionValues, spec: TierSpec[Any, Any], chunk_bytes: int) -> int:
    """The bytes tier ``spec`` keeps for a chunk of ``chunk_bytes`` (sealed or not)."""
    return chunk_bytes + SEAL_BYTES if sealed(config, spec) else chunk_bytes


def unsealed_shared(config: OptionValues, specs: Iterable[TierSpec[Any, Any]]) -> list[str]:
    """The enabled tiers other processes or machines reach that ``config`` leaves
    unsealed."""
    return [
        s.name
        for s in specs
        if s.enabled(config) and s.locality is Locality.REMOTE and not sealed(config, s)
    ]


def load_keys(config: OptionValues) -> SealKeys | None:
    """The key file's keys (None: no key file); ``ConfigError`` naming
    ``seal_key_file`` for a file that is missing, unsafe or not a key file, or when
    the cipher library is missing."""
    path = config.option(OPTION)
    if path is None:
        return None
    from kvoffload.sealing.keyfile import load
    from kvoffload.sealing.sealer import Sealer

    keys = load(path)
    Sealer(keys)  # the library is there and takes the keys
    return keys


def settle(config: OptionValues, specs: Iterable[TierSpec[Any, Any]]) -> SealKeys | None:
    """Check sealing at start: the key file when given; with ``seal_required``, a key
    file whenever a store others reach is enabled (``ConfigError`` naming the stores)."""
    open_to_others = unsealed_shared(config, specs)
    if config.option("seal_required") and open_to_others:
        raise ConfigError(
            "seal_required",
            f"{', '.join(open_to_others)} would keep chunks unsealed: set seal_key_file "
            "(make one with: kvoffload seal-key new PATH)",
        )
    return load_keys(config)


def describe(
    config: OptionValues, specs: Iterable[TierSpec[Any, Any]], keys: SealKeys | None
) -> str:
    """The start-up line's part on sealing ("" when no tier is sealed or shared)."""
    specs = [s for s in specs if s.enabled(config)]
    on = [s.name for s in specs if sealed(config, s)]
    open_to_others = unsealed_shared(config, specs)
    parts: list[str] = []
    if on and keys is not None:
        more = f", {len(keys.keys) - 1} more to open" if len(keys.keys) > 1 else ""
        parts.append(f"sealed {'+'.join(on)} (AES-256-GCM, key {keys.ids()[0]}{more})")
    if open_to_others:
        parts.append(
            f"UNSEALED {'+'.join(open_to_others)}: every client of the store can read "
            "and write every chunk (set seal_key_file)"
        )
    return "; ".join(parts)
