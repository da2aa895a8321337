"""Where a transfer job's bytes go: its *legs*, each between two media.

Three media hold KV: the engine's blocks (:data:`ENGINE`), host slots (:data:`HOST`)
and the lower tiers, each by its name (:func:`lower`). A job moves chunks along one or
two legs; each :class:`Leg` is a (source, destination) pair of :class:`Endpoint` and
the indices (in the job, ascending) of the chunks it moves. :func:`legs` says, for
every job shape the scheduler half builds (:mod:`kvoffload.core.jobs`):

=====================================  =========================================
job                                    legs
=====================================  =========================================
a load                                 host -> engine, every chunk
a store                                engine -> host, every chunk
a spill to tier ``t``                  host -> ``t``, every chunk
a promotion from tier ``t``            ``t`` -> host, every chunk
a tier load from ``t``                 host -> engine for its host chunks (if
                                       any), then ``t`` -> engine for its
                                       ``NO_SLOT`` chunks
a load of invalid blocks only          none (it moves nothing)
=====================================  =========================================

Contract: a job's legs partition its chunks (every chunk on exactly one leg, no leg
empty), no two legs of a job share a :data:`Route` (a route is the pair of media
kinds), every route is one of :data:`ROUTES`, and legs come nearest medium first (a
leg from host memory before one from a lower tier): the order in which
:func:`merge` picks a failed job's ``error``. This module is the one place that
tells a tier load from a host load; the worker backends dispatch each leg by its
route (a table keyed by :data:`Route`), and a backend that runs a job's legs apart
merges their results with :class:`LegResults` (or :func:`merge`).

Pure Python: no torch, no vLLM.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TypeAlias

from kvoffload.core.errors import ContractViolation
from kvoffload.core.jobs import NO_SLOT, JobKind, JobResult, TierJob, TransferJob


class Medium(enum.Enum):
    """The kind of an endpoint: what a backend needs to pick a lane."""

    ENGINE = "engine"  # the engine's KV blocks
    HOST = "host"  # host memory's slots
    TIER = "tier"  # a lower tier, by name

    __hash__ = object.__hash__  # singletons: by identity (hashed per leg, on hot paths)


@dataclass(frozen=True)
class Endpoint:
    """One end of a leg: a medium and, for a lower tier, its name (``tier``: empty
    for the engine and host memory). Raises :class:`ContractViolation` when a lower
    tier has no name or another medium has one."""

    medium: Medium
    tier: str = ""

    def __post_init__(self) -> None:
        if (self.medium is Medium.TIER) != bool(self.tier):
            raise ContractViolation(
                f"endpoint {self.medium.value}: a lower tier, and only it, has a name"
            )

    @property
    def name(self) -> str:
        """The medium's label everywhere (metrics, lanes): a lower tier's name,
        ``"host"`` or ``"engine"``."""
        return self.tier or self.medium.value


ENGINE = Endpoint(Medium.ENGINE)
HOST = Endpoint(Medium.HOST)


def lower(tier: str) -> Endpoint:
    """The lower tier named ``tier``."""
    return Endpoint(Medium.TIER, tier)


Route: TypeAlias = tuple[Medium, Medium]
"""A leg's (source kind, destination kind): what a backend's dispatch table is keyed by."""

FROM_HOST: Route = (Medium.HOST, Medium.ENGINE)  # a load's chunks from host slots
TO_HOST: Route = (Medium.ENGINE, Medium.HOST)  # a store
SPILL: Route = (Medium.HOST, Medium.TIER)  # host slots to a lower tier
PROMOTE: Route = (Medium.TIER, Medium.HOST)  # a lower tier to host slots
FROM_TIER: Route = (Medium.TIER, Medium.ENGINE)  # a load's chunks straight from a tier

ROUTES: frozenset[Route] = frozenset({FROM_HOST, TO_HOST, SPILL, PROMOTE, FROM_TIER})
"""Every route a job's leg may take."""


@dataclass(frozen=True)
class Leg:
    """``chunks`` (indices in the job, ascending, at least one) moved from ``source``
    to ``destination``."""

    source: Endpoint
    destination: Endpoint
    chunks: tuple[int, ...]

    @property
    def route(self) -> Route:
        return (self.source.medium, self.destination.medium)

    @property
    def tier(self) -> str | None:
        """The lower tier at either end, None for a leg between host and engine."""
        return self.source.tier or self.destination.tier or None


def legs(job: TransferJob) -> tuple[Leg, ...]:
    """The legs of ``job`` (the module docstring's table and contract)."""
    every = tuple(range(len(job.keys)))
    if isinstance(job, TierJob):
        tier = lower(job.tier)
        return (Leg(HOST, tier, every),) if job.kind is JobKind.SPILL else (Leg(tier, HOST, every),)
    if job.kind is JobKind.STORE:
        return (Leg(ENGINE, HOST, every),)
    if not every:  # a load of invalid blocks only
        return ()
    if job.tier is None:
        return (Leg(HOST, ENGINE, every),)
    host = tuple(i for i, slot in enumerate(job.slots) if slot != NO_SLOT)
    from_tier = tuple(i for i, slot in enumerate(job.slots) if slot == NO_SLOT)
    tier_leg = Leg(lower(job.tier), ENGINE, from_tier)
    return (Leg(HOST, ENGINE, host), tier_leg) if host else (tier_leg,)


def leg_on(job: TransferJob, route: Route) -> Leg | None:
    """The leg of ``job`` on ``route``, None if it has none."""
    return next((leg for leg in legs(job) if leg.route == route), None)


def tier_label(job: TransferJob) -> str:
    """The tier a job's transfer is labelled with (metrics, lanes): the lower tier one
    of its legs reads or writes, else ``"host"`` (a tier load's host chunks count
    under its tier: its slower part)."""
    return next((leg.tier for leg in legs(job) if leg.tier is not None), HOST.name)


def merge(job_id: int, results: Sequence[JobResult]) -> JobResult:
    """One job's result from its legs' results, in leg order: successful when every
    leg was; ``nbytes`` summed; ``seconds`` the longest leg's (legs run at once);
    ``error`` the first leg's that has one; ``failed_chunks`` every leg's, in leg
    order (each leg names chunks by their index in the job). No leg: a success that
    moved nothing. One leg: its result."""
    if len(results) == 1 and results[0].job_id == job_id:
        return results[0]
    return JobResult(
        job_id,
        success=all(r.success for r in results),
        nbytes=sum(r.nbytes for r in results),
        seconds=max((r.seconds for r in results), default=0.0),
        error=next((r.error for r in results if r.error), ""),
        failed_chunks=tuple(f for r in results for f in r.failed_chunks),
    )


class LegResults:
    """The results of one job's legs until every leg's came; owned by the backend that
    runs the legs apart. Each lane that runs a leg reports it under the routes it
    serves; the job has at most one leg among them."""

    def __init__(self, job_id: int, job_legs: Sequence[Leg]) -> None:
        self.job_id = job_id
        self._routes = tuple(leg.route for leg in job_legs)
        self._results: dict[Route, JobResult] = {}

    def waiting(self, lane: Collection[Route]) -> bool:
        """Whether the job has a leg on one of ``lane``'s routes whose result has
        not come."""
        return any(r in lane and r not in self._results for r in self._routes)

    def add(self, result: JobResult, lane: Collection[Route]) -> JobResult | None:
        """Record ``result`` as the job's leg on one of ``lane``'s routes; the merged
        result (:func:`merge`) once every leg's came, else None. Raises
        :class:`ContractViolation` when the job has no leg there, or it came already."""
        route = next((r for r in self._routes if r in lane), None)
        if route is None or route in self._results or result.job_id != self.job_id:
            raise ContractViolation(f"job {result.job_id}: no leg open for this result")
        self._results[route] = result
        if len(self._results) < len(self._routes):
            return None
        return merge(self.job_id, [self._results[r] for r in self._routes])
