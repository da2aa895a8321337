"""What kvoffload says when an engine starts: one summary line per role, and a
warning for each tier that starts degraded.

The scheduler role (one per engine) prints the tiers and their capacity in chunks
(each lower tier describes itself: ``TierSpec.describe``), the chunk size, the
policies and the load-failure policy it set; each worker prints its rank, the KV
layout it registered, its host slab and the copy path. Warnings: each tier's own
(``TierSpec.warn``: a password given inline; ``TierSpec.worker_notes``: a store that
opened degraded; a server that does not answer at start is warned about as its index
opens), and the numpy copy path where the compiled kernel is missing.
:func:`record_namespace` (``tiers/namespace_records.py``) writes a namespace's record
where a tier keeps it, for ``kvoffload inspect``, and logs a failure.

Contract: these functions only read the objects they are given and log; nothing
here raises.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from kvoffload.core.config.typed import OffloadConfig
from kvoffload.inspection.render import human_bytes as size
from kvoffload.sealing import policy as seal_policy
from kvoffload.tiers.build import enabled_tiers
from kvoffload.tiers.namespace_records import record_namespace
from kvoffload.tiers.registry import LOWER_TIERS

__all__ = ["record_namespace", "scheduler_summary", "warn_tiers", "worker_summary"]

logger = logging.getLogger("kvoffload")


def warn_tiers(config: OffloadConfig) -> None:
    """Each tier's start-up warnings about ``config``; sealing checked (the key file
    read, ``seal_required`` enforced: ``ConfigError`` naming the option)."""
    for spec in LOWER_TIERS:
        spec.warn(config)
    seal_policy.settle(config, LOWER_TIERS)


def sealing_note(config: OffloadConfig) -> str:
    """The start-up line's part on sealing: the sealed tiers and the key, and every
    store others reach that is left unsealed (decision 0024)."""
    return seal_policy.describe(config, LOWER_TIERS, seal_policy.load_keys(config))


def scheduler_summary(
    config: OffloadConfig,
    *,
    chunk_tokens: int,
    chunk_bytes: int,
    world_size: int,
    host_chunks: int,
    tier_chunks: Mapping[str, int],
    load_failure_policy: str,
    codecs: Mapping[str, str] | None = None,
    chunk_sizes: Mapping[str, int] | None = None,
    raw_chunk_bytes: int | None = None,
) -> str:
    """The scheduler role's one start-up line (``chunk_bytes``: all ranks together,
    as host memory keeps a chunk; ``codecs`` and ``chunk_sizes``: each tier's codec
    and chunk bytes, by name; ``raw_chunk_bytes``: as the engine's blocks hold it;
    ``tier_chunks``: each lower tier's capacity in chunks)."""
    tiers = [f"host {size(config.cpu_bytes)} = {host_chunks} chunks ({config.eviction})"]
    for spec in enabled_tiers(config):
        tiers.append(spec.describe(config, tier_chunks.get(spec.name, 0)))
    admission = config.lower_tier_admission
    parts = [
        "kvoffload: on (scheduler)",
        f"chunk {chunk_tokens} tokens = {size(chunk_bytes)}"
        + (f" over {world_size} ranks" if world_size > 1 else "")
        + _codec_note(codecs or {}, chunk_sizes or {}, raw_chunk_bytes),
        "tiers: " + "; ".join(tiers),
        f"store after {config.store_threshold} lookup(s)",
    ]
    if len(tiers) > 1:
        parts.append(
            "lower tiers: write-through"
            if admission == "write_through"
            else f"lower tiers: after {admission} host hits"
        )
    sealing = sealing_note(config)
    if sealing:
        parts.append(sealing)
    parts.append(f"kv_load_failure_policy={load_failure_policy}")
    if config.metrics_port is not None:
        parts.append(f"metrics http://127.0.0.1:{config.metrics_port}/metrics")
    return ", ".join(parts)


def _codec_note(codecs: Mapping[str, str], sizes: Mapping[str, int], raw: int | None) -> str:
    """`` (codec fp8 in every tier: 4.00x smaller than 128 KiB)``, or per tier
    `` (codecs: host none 1.00x, disk fp8 4.00x, redis lossless <= 1.00x, measured on
    /metrics; raw 128 KiB)``; nothing without a codec. A slot's ratio for fixed-size
    codecs; lossless shrinks each chunk by what it holds (``kvoffload_codec_ratio``)."""
    if raw is None or set(codecs.values()) <= {"none"}:
        return ""

    def ratio(tier: str) -> str:
        shown = f"{raw / sizes.get(tier, raw):.2f}x"
        return f"<= {shown}, measured on /metrics" if codecs[tier] == "lossless" else shown

    if len(set(codecs.values())) == 1:
        codec, tier = next(iter(codecs.values())), next(iter(codecs))
        return f" (codec {codec} in every tier: {ratio(tier)} smaller than {size(raw)})"
    each = ", ".join(f"{tier} {codec} {ratio(tier)}" for tier, codec in codecs.items())
    return f" (codecs: {each}; raw {size(raw)})"


def worker_summary(
    *,
    rank: int,
    world_size: int,
    layers: int,
    device: str,
    slab_bytes: int,
    slots: int,
    copy_path: str,
    tiers: list[str],
) -> str:
    """A worker's one start-up line."""
    return (
        f"kvoffload: on (worker rank {rank} of {world_size}): {layers} KV layers on "
        f"{device}, host slab {size(slab_bytes)} = {slots} chunks, copies: {copy_path}, "
        f"tiers below host: {', '.join(tiers) if tiers else 'none'}"
    )
