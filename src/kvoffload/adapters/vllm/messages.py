"""The two per-step messages between the connector's halves, in vLLM's types.

Scheduler -> workers: :class:`PlanMetadata` carries kvoffload's :class:`StepPlan`.
Workers -> scheduler: :class:`ReportMetadata` carries each worker's
:class:`WorkerReport`; vLLM merges the workers' metadata with ``aggregate`` and the
scheduler half counts completions per rank. Once, at start, before the first step:
:class:`WeightsHandshake`, each worker's weights fingerprint, through vLLM's
connector handshake (only when kvoffload is the engine's connector itself: under
``MultiConnector`` the handshake belongs to the P/D connector, and the fingerprints
come with the first reports instead). LoRA adapters (decision 0025): each plan names
what its loads and stores of requests with an adapter were keyed with
(``PlanMetadata.loras``), each report the adapters a worker loaded
(``ReportMetadata.loras``). All are immutable and picklable.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvoffload.adapters.vllm.compat import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)
from kvoffload.adapters.vllm.lora_identity import LoraStamp
from kvoffload.core.identity.weights import WeightsStamp
from kvoffload.core.jobs import StepPlan, WorkerReport


@dataclass(frozen=True)
class PlanMetadata(KVConnectorMetadata):
    plan: StepPlan
    session: bytes | None = None
    """The engine's session on its node-shared host tier (None: a private one): each
    worker holds a lease on it before running the plan's jobs (decision 0016)."""
    weights: WeightsStamp | None = None
    """The weights check asked for and the fingerprints the plan's keys name; a worker
    whose fingerprint differs refuses the plan's loads and stores (decision 0019)."""
    slab_id: bytes | None = None
    """The id of the share's slab files the plan's host slots are in (None: a private
    host tier, or no node process answered): a worker whose slab is another fails
    the plan's jobs that touch host slots (decision 0018)."""
    loras: LoraStamp | None = None
    """The adapter digest each request with a load or store in the plan was keyed
    with; a worker refuses those jobs unless it holds that adapter (decision 0025)."""


@dataclass(frozen=True)
class ReportMetadata(KVConnectorWorkerMetadata):
    reports: tuple[WorkerReport, ...] = ()
    namespaces: tuple[tuple[int, bytes], ...] = ()
    """(rank, namespace digest) each worker derived, sent once with its first report:
    the scheduler half checks they are its own (``SchedulerSide``)."""
    weights: tuple[tuple[int, int, bytes], ...] = ()
    """(rank, check, fingerprint) of each worker that fingerprinted its weights since
    its last report: check 0 with its first report, then once per check a plan asked
    for (decision 0019)."""
    loras: tuple[tuple[int, int, str], ...] = ()
    """(rank, lora_int_id, digest) of each LoRA adapter load a worker did since its
    last report (decision 0025)."""

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, ReportMetadata):
            return self
        return ReportMetadata(
            self.reports + other.reports,
            self.namespaces + other.namespaces,
            self.weights + other.weights,
            self.loras + other.loras,
        )


@dataclass(frozen=True)
class WeightsHandshake(KVConnectorHandshakeMetadata):
    """A worker's weights fingerprint at start (check 0, decision 0019)."""

    rank: int
    fingerprint: bytes
