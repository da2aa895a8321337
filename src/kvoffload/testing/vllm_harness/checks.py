"""What the harness checks at every step and at the end of a run.

:class:`Checks` owns the harness's record of every job planned and of what was stored
and spilled since the last connector reset; it reads (never changes) vLLM's scheduler,
kvoffload's scheduler side and the KV model. Every failed check raises
:class:`HarnessViolation`.
"""

from __future__ import annotations

import traceback
from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING

from vllm.v1.core.sched.scheduler import Scheduler

from kvoffload.adapters.vllm.scheduler_side import SchedulerSide
from kvoffload.core.jobs import EngineJob, JobKind, StepPlan, TransferJob
from kvoffload.core.keys import ChunkKey
from kvoffload.testing.vllm_harness.kv_model import KVModel, ReadMismatch

if TYPE_CHECKING:
    from kvoffload.testing.vllm_harness.ranks import Child, Rank


class HarnessViolation(AssertionError):
    """A check of the harness failed."""


def failure_message(exc: BaseException) -> str:
    """What a failed run reports: a harness check's own message, or any other
    exception's type and message with the last frames of its traceback."""
    if isinstance(exc, HarnessViolation):
        return str(exc)
    return f"{type(exc).__name__}: {exc}\n" + "".join(traceback.format_exception(exc)[-6:])


class Checks:
    def __init__(
        self,
        scheduler: Scheduler,
        side: SchedulerSide,
        model: KVModel,
        *,
        check_provenance: bool,
        expect_anomalies: bool,
    ) -> None:
        self.scheduler = scheduler
        self.side = side
        self.model = model
        self.check_provenance = check_provenance  # lower tiers started empty
        self.expect_anomalies = expect_anomalies
        self.jobs: dict[int, TransferJob] = {}  # every job planned, by id
        self.loads_checked = 0
        self._loads: dict[str, tuple[EngineJob, set[int]]] = {}  # and blocks failed so far
        self._stored: set[ChunkKey] = set()  # stored or promoted since the last reset
        self._spilled: set[ChunkKey] = set()  # spilled since the last reset

    def share_stored(self, stored: set[ChunkKey], spilled: set[ChunkKey] | None = None) -> None:
        """Judge loads against ``stored`` from now on: the chunks every engine over one
        node-shared host tier stored (``fleet.py`` owns it and hands the same set to
        every engine's checks); and tier reads against ``spilled``, the chunks every
        engine spilled to a lower tier they share, when they share one."""
        self._stored = stored
        if spilled is not None:
            self.share_spilled(spilled)

    def share_spilled(self, spilled: set[ChunkKey]) -> None:
        """Judge tier reads against ``spilled`` from now on: the chunks every engine
        sharing one lower tier spilled to it (the caller owns the set and hands it to
        every engine's checks)."""
        self._spilled = spilled

    def connector_reset(self) -> None:
        self._stored.clear()
        self._spilled.clear()

    def plan(self, plan: StepPlan) -> None:
        """No load or store names the null block; no load for a request with jobs in
        flight; loads and promotions name only chunks written since the last
        connector reset (a tier load's tier chunks: spilled since then)."""
        half = self.side.scheduler
        planned: tuple[TransferJob, ...] = (
            *plan.loads,
            *plan.stores,
            *plan.spills,
            *plan.promotions,
        )
        for job in planned:
            self.jobs[job.job_id] = job
        for job in (*plan.loads, *plan.stores):
            if self.model.null_block in job.moved_blocks():
                raise HarnessViolation(
                    f"{job.kind.value} {job.job_id} of {job.request_id!r} names vLLM's null block"
                )
        for load in plan.loads:
            others = [
                j.job_id
                for j in half.jobs_in_flight()
                if j.request_id == load.request_id and j.job_id != load.job_id
            ]
            if others:
                raise HarnessViolation(
                    f"load {load.job_id} planned for {load.request_id!r} with jobs {others} "
                    "in flight"
                )
            from_tier = set(load.tier_chunks()) if load.tier is not None else set()
            stale = [
                k
                for i, k in enumerate(load.keys)
                if k not in (self._spilled if i in from_tier else self._stored)
            ]
            if self.check_provenance and stale:
                raise HarnessViolation(
                    f"load {load.job_id} of {load.request_id!r} names {len(stale)} "
                    "chunks not stored (or, read from a tier, spilled) since the last "
                    "connector reset"
                )
            if load.keys:
                self._loads[load.request_id] = (load, set())
        for promotion in plan.promotions:
            if self.check_provenance and not set(promotion.keys) <= self._spilled:
                raise HarnessViolation(
                    f"promotion {promotion.job_id} names chunks not spilled since the last "
                    "connector reset"
                )
        writes_host: tuple[TransferJob, ...] = (*plan.stores, *plan.promotions)
        for job in writes_host:
            self._stored.update(job.keys)
        for job in plan.spills:
            self._spilled.update(job.keys)

    def writes(self, rank: int, entry: Child, written: set[int], step: int) -> None:
        """No store copy of this connector still running on the rank reads a block
        this step writes (any connector's loads and the forward pass)."""
        for job_id in entry.copier.running():
            job = self.jobs.get(job_id)
            if not isinstance(job, EngineJob) or job.kind is not JobKind.STORE:
                continue
            hit = written.intersection(job.moved_blocks())
            if hit:
                raise HarnessViolation(
                    f"step {step} rank {rank}: store {job_id} of {job.request_id!r} still "
                    f"reads blocks {sorted(hit)} that this step writes (no flush)"
                )

    def landed(
        self,
        finished_recving: Iterable[str],
        invalid_blocks: set[int],
        failed_recving: Collection[str] = (),
    ) -> None:
        """A load reported done (and failed on no rank: none of its blocks invalid,
        its request not in ``failed_recving``) filled its blocks with the loading
        request's own KV, of the group whose block table holds each block (a block
        belongs to one group at a time; :data:`NO_BLOCK` entries are not written and
        not checked)."""
        for _, invalid in self._loads.values():
            invalid.update(invalid_blocks)  # a rank may report them before the end
        for request_id in finished_recving:
            entry = self._loads.pop(request_id, None)
            if entry is None or entry[1].intersection(entry[0].block_ids):
                continue
            if request_id in failed_recving:
                continue
            if request_id not in self.scheduler.requests:
                continue
            self._check_load(request_id, entry[0])
            self.loads_checked += 1

    def _check_load(self, request_id: str, job: TransferJob) -> None:
        assert isinstance(job, EngineJob)  # a load
        tokens = list(self.scheduler.requests[request_id].all_token_ids)
        tables = self.scheduler.kv_cache_manager.get_block_ids(request_id)
        size = self.model.block_size
        for block in job.moved_blocks():
            for group, blocks in enumerate(tables):
                if block not in blocks:
                    continue
                start = blocks.index(block) * size
                try:
                    self.model.check(
                        request_id, tokens, blocks, start, start + size, group=group,
                        what=f"load {job.job_id}",
                    )  # fmt: skip
                except ReadMismatch as exc:
                    raise HarnessViolation(str(exc)) from None

    def step(self) -> None:
        """The invariants that hold after every step."""
        if self.side.guard.errors:
            raise HarnessViolation(
                "internal error at the vLLM boundary:\n" + self.side.guard.errors[0]
            )
        half = self.side.scheduler
        if half.anomalies.counts and not self.expect_anomalies:
            raise HarnessViolation(f"anomalies counted on vLLM: {half.anomalies.counts}")
        try:
            half.check_integrity()
        except AssertionError:
            raise
        except Exception as exc:
            raise HarnessViolation(f"integrity: {exc}") from None

    def late_copies(self, ranks: Iterable[Rank]) -> None:
        """No staged copy of a tier load after it was reported timed out: its engine
        blocks were vLLM's again (recomputed, or another request's)."""
        for entry in ranks:
            if entry.late_copies:
                raise HarnessViolation(
                    f"rank {entry.rank}: tier loads {sorted(set(entry.late_copies))} copied "
                    "into engine blocks after they were reported timed out"
                )

    def quiescent(self, ranks: Iterable[tuple[int, Child]]) -> None:
        """Nothing left anywhere: every request gone, every pin, slot, job, engine
        block and copy released."""
        half = self.side.scheduler
        problems = []
        if half.jobs_in_flight():
            problems.append(f"jobs in flight {[j.job_id for j in half.jobs_in_flight()]}")
        if half.request_ids():
            problems.append(f"requests tracked {half.request_ids()}")
        if half.directory.pinned_count or half.directory.storing_count:
            problems.append("host slots pinned or storing")
        for tier in half.tiers.directory_tiers():
            if tier.directory.pinned_count or tier.directory.storing_count:
                problems.append(f"{tier.name} slots pinned or storing")
        pool = self.scheduler.kv_cache_manager.block_pool
        if pool.get_num_free_blocks() != pool.num_gpu_blocks - 1:
            problems.append("engine blocks not freed")
        for rank, entry in ranks:
            if entry.copier.running() or any(lane.running() for lane in entry.lanes()):
                problems.append(f"rank {rank} still copying")
        if problems:
            raise HarnessViolation("not quiescent: " + "; ".join(problems))
        self.step()
