"""One tensor-parallel worker of the harness and its share of an engine step.

A :class:`Rank` is a real worker-role ``KVOffloadConnector`` (or vLLM's
``MultiConnector`` over several, each a :class:`Child`) over that rank's KV
tensors, with every copy gated (:class:`CopyGate`; a tier load's host half among
them) and its tier lane and staged loads gated (:class:`GatedTiers`: spills and
promotions, tier loads' tier halves), both released or failed by the policy's
``tier_jobs``; :func:`run_step` makes the connector calls vLLM's model runner
makes in one ``execute_model``, in vLLM's order, with the forward pass in its place.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from vllm.config import KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiConnector,
    MultiKVConnectorMetadata,
    MultiKVConnectorWorkerMetadata,
)
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.outputs import KVConnectorOutput

from kvoffload.adapters.vllm.compat import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from kvoffload.adapters.vllm.connector import KVOffloadConnector
from kvoffload.adapters.vllm.messages import PlanMetadata, ReportMetadata
from kvoffload.adapters.vllm.worker_side import WorkerSide
from kvoffload.core.jobs import EngineJob, TierJob, TransferJob, WorkerReport
from kvoffload.testing.vllm_harness.completions import Completions
from kvoffload.testing.vllm_harness.gates import CopyGate, GatedTiers
from kvoffload.testing.vllm_harness.hangs import IoHangs, settle
from kvoffload.testing.vllm_harness.spec import layer_names
from kvoffload.transfer.staged_loads import StagedLoads
from kvoffload.transfer.worker import TransferWorker


@dataclass
class Child:
    """One kvoffload worker connector of a rank (the rank's connector itself, or one
    child of its ``MultiConnector``), with its gates."""

    connector: KVOffloadConnector
    side: WorkerSide
    copier: TransferWorker
    gate: CopyGate
    tiers: GatedTiers[TierJob] | None
    staged: GatedTiers[EngineJob] | None = None  # tier loads' tier halves
    open_copies: dict[int, EngineJob] = field(default_factory=dict)  # submitted, unreported
    hangs: IoHangs = field(default_factory=IoHangs)  # the tier calls parked (hung I/O)
    timed_out_loads: set[int] = field(default_factory=set)  # tier loads reported TIMEOUT
    late_copies: list[int] = field(default_factory=list)  # staged copies of those (a bug)

    def lanes(self) -> list[GatedTiers[TierJob] | GatedTiers[EngineJob]]:
        """The gated tier lane and staged loads this child has."""
        return [lane for lane in (self.tiers, self.staged) if lane is not None]


@dataclass
class Rank:
    """One worker: ``connector`` is what vLLM's model runner calls (kvoffload's, or a
    ``MultiConnector`` over several); ``children`` its kvoffload connectors in the
    ``MultiConnector``'s order, the one under test last."""

    rank: int
    connector: KVConnectorBase_V1
    children: list[Child]
    hangs: IoHangs = field(default_factory=IoHangs)  # the tier calls parked (hung I/O)

    @property
    def under_test(self) -> Child:
        return self.children[-1]

    @property
    def late_copies(self) -> list[int]:
        """Staged copies of tier loads already reported timed out, any child's."""
        return [job for c in self.children for job in c.late_copies]


def make_rank(
    rank: int,
    vllm_config: VllmConfig,
    kv_cache_config: KVCacheConfig,
    kv: torch.Tensor,
    *,
    clock: Callable[[], float],
    hangs: IoHangs,
    weights: Callable[[int], bytes] | None = None,
) -> Rank:
    """Rank ``rank``'s connector, registered over ``kv`` (``[layers, blocks, ...]``) as
    vLLM registers a hybrid model's KV: every group's layer names, layer ``i`` of
    each group a view of ``kv[i]`` (the groups' tensors alias). Under a
    ``MultiConnector`` config the rank's connector is vLLM's ``MultiConnector`` and
    every kvoffload child is gated. Tier I/O deadlines run on ``clock``; tier calls
    may be hung by ``hangs``; every copy of a staged tier load is recorded (a copy of
    a load already reported timed out is a late write into engine blocks vLLM has
    back: ``late_copies``). ``weights(rank)`` is the rank's weights fingerprint as
    the fake model's weights stand (decision 0019)."""
    connector: KVConnectorBase_V1
    if isinstance(vllm_config.kv_transfer_config, KVTransferConfig) and (
        vllm_config.kv_transfer_config.kv_connector == "MultiConnector"
    ):
        connector = MultiConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
        kids = [c for c in connector.sub_connectors if isinstance(c, KVOffloadConnector)]
    else:
        connector = KVOffloadConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
        kids = [connector]
    for kid in kids:
        assert kid.worker_side is not None
        kid.worker_side.copy_hook = CopyGate()
        kid.worker_side.rank_override = rank
        kid.worker_side.clock = clock
        kid.worker_side.io_hook = hangs.hook(rank)
        kid.worker_side.top_level = kid is connector  # not a MultiConnector's child
        if weights is not None:
            kid.worker_side.weights.source = lambda: weights(rank)
    groups = len(kv_cache_config.kv_cache_groups)
    connector.register_kv_caches(
        {name: kv[i] for g in range(groups) for i, name in enumerate(layer_names(g))}
    )
    return Rank(rank, connector, [_gated(kid, hangs) for kid in kids], hangs)


def _gated(connector: KVOffloadConnector, hangs: IoHangs) -> Child:
    """Gate the registered connector's copies, tier lane and staged loads."""
    side = connector.worker_side
    assert side is not None and side.runner is not None
    gate = side.copy_hook
    assert isinstance(gate, CopyGate)
    backend = side.runner.backend
    copier = backend.worker
    tiers = GatedTiers(backend.tiers) if backend.tiers is not None else None
    staged = GatedTiers(backend.staged) if backend.staged is not None else None
    inner_staged = backend.staged
    backend.tiers, backend.staged = tiers, staged
    entry = Child(connector, side, copier, gate, tiers, staged, hangs=hangs)
    if isinstance(inner_staged, StagedLoads):
        for staging in inner_staged.staging_workers.values():
            _record_staged_copies(entry, staging)
    store, load = copier.submit_store, copier.submit_load

    def submit_store(job: EngineJob) -> None:
        gate.submitted(job)
        entry.open_copies[job.job_id] = job
        store(job)

    def submit_load(job: EngineJob) -> None:
        gate.submitted(job)
        entry.open_copies[job.job_id] = job
        load(job)

    copier.submit_store = submit_store  # type: ignore[method-assign]
    copier.submit_load = submit_load  # type: ignore[method-assign]
    return entry


def plans_of(meta: KVConnectorMetadata) -> list[PlanMetadata]:
    """Each kvoffload child's plan in a step's connector metadata, in child order."""
    if isinstance(meta, MultiKVConnectorMetadata):
        return [m for m in meta.metadata if isinstance(m, PlanMetadata)]
    assert isinstance(meta, PlanMetadata), type(meta)
    return [meta]


def _record_staged_copies(entry: Child, staging: TransferWorker) -> None:
    """Note every staged copy (on its lane thread) of a load reported timed out."""
    submit = staging.submit_load

    def submit_load(job: EngineJob) -> None:
        if job.job_id in entry.timed_out_loads:
            entry.late_copies.append(job.job_id)
        submit(job)

    staging.submit_load = submit_load  # type: ignore[method-assign]


def run_step(
    entry: Rank,
    meta: KVConnectorMetadata,
    finished_req_ids: set[str],
    *,
    step: int,
    policy: Completions,
    forward: Callable[[Rank], None],
) -> KVConnectorOutput:
    """The rank's connector calls of one execute_model; ``forward`` is the forward
    pass (and the checks before it). Transfers finish as ``policy`` says."""
    connector = entry.connector
    for child, plan in zip(entry.children, plans_of(meta), strict=True):
        child.gate.release(plan.plan.flush)  # a flush waits for its jobs
    connector.handle_preemptions(meta)
    connector.bind_connector_metadata(meta)
    forward(entry)
    connector.start_load_kv(None)  # type: ignore[arg-type]
    connector.wait_for_save()  # type: ignore[no-untyped-call]
    for child in entry.children:
        _complete(entry.rank, child, step, policy)
    results = connector.get_transfer_results(finished_req_ids)
    invalid = connector.get_block_ids_with_load_errors()
    worker_meta = connector.build_connector_worker_meta()
    connector.clear_connector_metadata()
    if isinstance(worker_meta, ReportMetadata):
        worker_meta = _ordered(entry.rank, entry.children[0], step, policy, worker_meta)
    elif isinstance(worker_meta, MultiKVConnectorWorkerMetadata):
        worker_meta = MultiKVConnectorWorkerMetadata(
            tuple(
                _ordered(entry.rank, child, step, policy, m) if isinstance(m, ReportMetadata) else m
                for child, m in zip(entry.children, worker_meta.metadata, strict=True)
            )
        )
    return KVConnectorOutput(
        finished_recving=results.finished_recving or None,
        failed_recving=results.failed_recving,
        invalid_block_ids=invalid,
        kv_connector_worker_meta=worker_meta,
    )


def _complete(rank: int, entry: Child, step: int, policy: Completions) -> None:
    """Release and fail what the policy says, then wait until it finished."""
    jobs = [entry.open_copies[i] for i in sorted(entry.open_copies)]
    release, fail = policy.copies(rank, step, jobs)
    entry.gate.release(release)
    entry.gate.fail(fail)
    for lane in entry.lanes():
        held: list[TransferJob] = [lane.held[i] for i in sorted(lane.held)]
        release, fail = policy.tier_jobs(rank, step, held)
        lane.fail(fail)
        lane.release(release)
        settle(lane, rank, entry.hangs)
    entry.copier.wait(set(entry.open_copies) & entry.gate.let_through())


def _ordered(
    rank: int, entry: Child, step: int, policy: Completions, meta: ReportMetadata
) -> ReportMetadata:
    """The child's report in a deterministic order (the policy's); its finished
    copies are no longer open."""
    reports = []
    for report in meta.reports:
        results = sorted(report.results, key=lambda r: r.job_id)
        for result in results:
            entry.open_copies.pop(result.job_id, None)
            if any(f.timed_out for _, f in result.failed_chunks):
                entry.timed_out_loads.add(result.job_id)  # (ids of tier jobs never copy)
        ordered = tuple(policy.order(rank, step, results))
        reports.append(WorkerReport(report.rank, ordered, report.released))
    return ReportMetadata(tuple(reports), meta.namespaces, meta.weights)
