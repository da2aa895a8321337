"""The transfer worker: executes store and load jobs asynchronously, reports results.

One :class:`TransferWorker` per model worker (per parallel rank). It owns the copy
threads or CUDA streams and the :class:`ResultBook`; it borrows the engine's KV
tensors (through the :class:`KVLayout`) and the :class:`HostSlab`.

Contract:

- ``submit_store`` / ``submit_load`` never raise for a bad or failing job: a job that
  fails validation, whose copy raises, or that is submitted after ``shutdown``
  becomes a failed :class:`JobResult` (``error`` says why). Other jobs are not
  affected. The one exception: submitting a job id that is still in flight raises
  :class:`ContractViolation` (ids are unique; a duplicate is a scheduler bug).
- ``poll`` returns each job's result exactly once, in finishing order. ``nbytes``
  counts the block records moved, ``seconds`` the copy itself (not the queueing).
- Jobs of one direction run in submission order; stores and loads run concurrently.
  A store reads engine blocks while they stay unwritten: overwriting them before
  the store finished is prevented by the scheduler's flush fence, i.e. ``wait``.
- ``shutdown`` fails queued jobs, lets running copies finish (or, past ``timeout``,
  fails them and drops their late completion), and never raises.
- ``fence`` (the engine's KV memory is released: vLLM's sleep mode) makes every job
  submitted from then on fail at once with the fence's error, and the jobs it names
  fail even after ``lift``; ``drain`` waits for the jobs submitted before the fence;
  ``remap`` re-derives the layout from the KV tensors while nothing runs.

On CPU every job runs on its direction's thread; ``hook(job)`` (tests) is called
there right before the copy: raising fails the job, blocking holds it and every later
job of that direction. On CUDA the hook is called on the submitting thread before the
copy is enqueued, and completion is observed by polling CUDA events.

Threads: on CPU, ``submit_*``, ``poll``, ``wait`` and ``report`` may be called from any
thread. On CUDA call them from one thread (the engine's); in-flight events are not
shared. ``threads`` (CPU only) splits each job between that many copy threads.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterable, Mapping

import torch

from kvoffload.codecs.chunk_codec import ChunkCodec, Fp8Chunks, open_kv_codec
from kvoffload.core.config.options import default
from kvoffload.core.errors import ConfigError, ContractViolation
from kvoffload.core.jobs import EngineJob, JobKind, JobResult, WorkerReport
from kvoffload.tiers.host import HostSlab
from kvoffload.tiers.slot_rows import SlotRows
from kvoffload.transfer.codec_copy import CodecCopier
from kvoffload.transfer.cpu_copy import CpuCopier
from kvoffload.transfer.cuda_codec_copy import CudaCodecCopier
from kvoffload.transfer.cuda_copy import CudaCopier, InFlight
from kvoffload.transfer.lanes import Lane
from kvoffload.transfer.layout import KVLayout, register_kv_caches
from kvoffload.transfer.plan import CopyPlan, JobRejected, merge_plans, plan_job
from kvoffload.transfer.results import ResultBook

CopyHook = Callable[[EngineJob], None]


class TransferWorker:
    """Moves chunks between the engine's KV blocks and host slots."""

    def __init__(
        self,
        layout: KVLayout,
        slab: SlotRows,
        blocks_per_chunk: int,
        *,
        threads: int = default("copy_threads"),
        rank: int = 0,
        hook: CopyHook | None = None,
        codec: ChunkCodec | None = None,
    ) -> None:
        raw = layout.chunk_bytes(blocks_per_chunk)
        stored = raw if codec is None else codec.stored_bytes
        if slab.chunk_bytes != stored or (codec is not None and codec.raw_bytes != raw):
            raise ContractViolation(
                f"slab chunks of {slab.chunk_bytes} B, but {blocks_per_chunk} blocks of "
                f"this layout are {raw} B ({stored} B stored)"
            )
        if codec is not None and layout.device.type == "cuda" and codec.name != "fp8":
            raise ConfigError(
                "host_codec",
                f"{codec.name} in host memory runs on the CPU copy path; KV on "
                f"{layout.device} keeps host memory in none or fp8 (a lower tier may take "
                f"{codec.name}: its <tier>_codec option)",
            )
        self.codec = codec
        self.layout = layout
        self.slab = slab
        self.blocks_per_chunk = blocks_per_chunk
        self.rank = rank
        self._hook = hook
        self._book = ResultBook()
        self._closed = False
        self._fence_lock = threading.Lock()  # a submission against a fence being set
        self._fence: str | None = None  # why every job fails at once now (None: they run)
        self._refused: dict[int, str] = {}  # jobs that fail at once even after ``lift``
        self._threads = threads
        self._cuda: CudaCopier | None = None
        self._cpu: CpuCopier | CodecCopier | None = None
        self._inflight: dict[int, InFlight] = {}
        self._lanes: dict[JobKind, Lane[EngineJob]] = {}
        if layout.device.type == "cuda":
            self._cuda = self._cuda_copier(layout)
        else:
            self._cpu = self._cpu_copier(layout)
            self._lanes = {
                kind: Lane(f"kvoffload-{kind.value}", functools.partial(self._run_batch, kind))
                for kind in (JobKind.STORE, JobKind.LOAD)
            }

    @classmethod
    def for_kv_caches(
        cls,
        kv_caches: Mapping[str, torch.Tensor],
        num_blocks: int,
        *,
        blocks_per_chunk: int,
        host_budget_bytes: int,
        threads: int = default("copy_threads"),
        rank: int = 0,
        hook: CopyHook | None = None,
        open_slab: Callable[[int], SlotRows] | None = None,
        codec: str = "none",
    ) -> TransferWorker:
        """Register ``kv_caches`` and allocate a host slab of ``host_budget_bytes``, or
        take the one ``open_slab(chunk_bytes)`` opens (a node-shared host tier's
        rank slab, :class:`~kvoffload.tiers.host_shared.SharedHostSlab`); with a
        ``codec``, slots of its stored size (ConfigError: a codec this KV cannot take)."""
        layout = register_kv_caches(kv_caches, num_blocks)
        raw = layout.chunk_bytes(blocks_per_chunk)
        chunk_codec = open_kv_codec(codec, [t.dtype for t in kv_caches.values()], raw)
        chunk_bytes = raw if chunk_codec is None else chunk_codec.stored_bytes
        slab = (
            HostSlab(chunk_bytes, host_budget_bytes)
            if open_slab is None
            else open_slab(chunk_bytes)
        )
        return cls(
            layout, slab, blocks_per_chunk, threads=threads, rank=rank, hook=hook,
            codec=chunk_codec,
        )  # fmt: skip

    def submit_store(self, job: EngineJob) -> None:
        """Start copying the job's engine blocks into its host slots."""
        self._submit(job, JobKind.STORE)

    def submit_load(self, job: EngineJob) -> None:
        """Start copying the job's host slots into its engine blocks (``skip_blocks``
        leading blocks of the first chunk are not written)."""
        self._submit(job, JobKind.LOAD)

    def poll(self) -> list[JobResult]:
        """Results of the jobs finished since the previous poll."""
        self._collect_cuda(wait_for=())
        return self._book.take()

    def report(self) -> WorkerReport:
        """``poll()`` wrapped as this rank's :class:`WorkerReport`."""
        return WorkerReport(self.rank, tuple(self.poll()))

    def running(self) -> set[int]:
        """Ids of the jobs submitted and not finished yet."""
        return self._book.running()

    def wait(self, job_ids: Iterable[int]) -> None:
        """Block until the given jobs finished; unknown or reported ids are fine.

        Their results stay queued for ``poll``.
        """
        ids = set(job_ids)
        self._collect_cuda(wait_for=ids)
        self._book.wait(ids)

    def fence(self, error: str, jobs: Iterable[int] = ()) -> None:
        """From now on every job submitted fails at once with ``error``; ``jobs`` (ids)
        fail so even after :meth:`lift` (a job that straddled the fence). Jobs
        submitted before keep running: :meth:`drain` waits for them."""
        with self._fence_lock:
            self._fence = error
            self._refused.update((job_id, error) for job_id in jobs)

    def lift(self) -> None:
        """Jobs submitted from now on run again (but those :meth:`fence` named)."""
        with self._fence_lock:
            self._fence = None

    def drain(self, *, collect: bool = True) -> None:
        """Wait for every job submitted and not finished. ``collect=False``: only wait
        for the book (on CUDA, the thread that submits this worker's jobs collects
        them: a staging worker's lane thread)."""
        if collect:
            self.wait(self.running())
        else:
            self._book.wait(self._book.running())

    def remap(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Derive the layout from ``kv_caches`` again (the same tensors after the
        engine got its KV memory back) and the copier over it. Call with nothing
        running (after :meth:`drain`, under a fence). Raises ContractViolation when
        the tensors' layout is not the one registered (the old views stay)."""
        layout = register_kv_caches(kv_caches, self.layout.num_blocks)
        if layout.description != self.layout.description:
            raise ContractViolation("the KV caches' layout changed since register_kv_caches")
        self.layout = layout
        if self._cuda is not None:
            self._cuda = self._cuda_copier(layout)
        if self._cpu is not None:
            old, self._cpu = self._cpu, self._cpu_copier(layout)
            old.close()

    def _cuda_copier(self, layout: KVLayout) -> CudaCopier:
        if isinstance(self.codec, Fp8Chunks):  # encoded on the GPU (decision 0023)
            return CudaCodecCopier(layout, self.slab, self.blocks_per_chunk, self.codec)
        return CudaCopier(layout, self.slab, self.blocks_per_chunk)

    def _cpu_copier(self, layout: KVLayout) -> CpuCopier | CodecCopier:
        if self.codec is None:
            return CpuCopier(layout, self.slab, self.blocks_per_chunk, threads=self._threads)
        return CodecCopier(
            layout, self.slab, self.blocks_per_chunk, self.codec, threads=self._threads
        )

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop: fail queued jobs, finish (or after ``timeout`` s, fail) running ones.

        Idempotent. Results stay available to ``poll``; later submissions fail.
        """
        self._closed = True
        for lane in self._lanes.values():
            for job in lane.close():
                self._book.fail(job.job_id, "cancelled: worker shut down before the copy started")
        self._collect_cuda(wait_for=set(self._inflight))
        if not self._book.wait(self._book.running(), timeout):
            for job_id in self._book.running():
                self._book.fail(job_id, "abandoned: still running at shutdown")
            return  # the copy threads stay busy; joining them could hang
        for lane in self._lanes.values():
            lane.join()
        if self._cpu is not None:
            self._cpu.close()

    def _submit(self, job: EngineJob, kind: JobKind) -> None:
        with self._fence_lock:
            self._book.begin(job.job_id)
            refused = self._refused.get(job.job_id, self._fence)
        if refused is not None:
            self._book.fail(job.job_id, refused)
        elif self._closed:
            self._book.fail(job.job_id, "worker is shut down")
        elif self._cuda is not None:
            self._start_cuda(job, kind)
        elif not self._lanes[kind].put(job):
            self._book.fail(job.job_id, "worker is shut down")

    def _plan(self, job: EngineJob, kind: JobKind) -> CopyPlan:
        if self._hook is not None:
            self._hook(job)
        return plan_job(
            job,
            kind,
            num_blocks=self.layout.num_blocks,
            num_slots=self.slab.num_slots,
            blocks_per_chunk=self.blocks_per_chunk,
            block_bytes=self.layout.block_bytes,
        )

    def _run_batch(self, kind: JobKind, jobs: list[EngineJob]) -> None:
        """Lane thread: validate each job, copy the valid ones in one pass, record every
        result (never raises). With a test hook, jobs run one at a time, so a hook
        that holds a job does not hold the jobs queued before it."""
        if self._hook is not None and len(jobs) > 1:
            for job in jobs:
                self._run_batch(kind, [job])
            return
        plans = []
        for job in jobs:
            try:
                plans.append(self._plan(job, kind))
            except Exception as exc:
                self._book.fail(job.job_id, _describe(exc))
        if not plans:
            return
        cpu = self._cpu
        if cpu is None:  # pragma: no cover - lanes exist only with a CPU copier
            return
        try:
            begin = time.perf_counter()
            (cpu.store if kind is JobKind.STORE else cpu.load)(merge_plans(plans))
            seconds = time.perf_counter() - begin
        except Exception as exc:
            for plan in plans:
                self._book.fail(plan.job.job_id, _describe(exc))
            return
        total = sum(plan.nbytes for plan in plans)
        for plan in plans:
            share = seconds * plan.nbytes / total if total else 0.0
            self._book.finish(JobResult(plan.job.job_id, True, plan.nbytes, share))

    def _start_cuda(self, job: EngineJob, kind: JobKind) -> None:
        assert self._cuda is not None
        try:
            plan = self._plan(job, kind)
            copy = self._cuda.store if kind is JobKind.STORE else self._cuda.load
            self._inflight[job.job_id] = copy(plan)
        except Exception as exc:
            self._book.fail(job.job_id, _describe(exc))

    def _collect_cuda(self, wait_for: Iterable[int]) -> None:
        """Finish every in-flight CUDA job whose end event completed; block on
        ``wait_for`` first."""
        for job_id in wait_for:
            entry = self._inflight.get(job_id)
            if entry is not None:
                try:
                    entry.synchronize()
                except Exception as exc:
                    del self._inflight[job_id]
                    self._book.fail(job_id, _describe(exc))
        for job_id, entry in list(self._inflight.items()):
            try:
                if not entry.done():
                    continue
                entry.verify()
                result = JobResult(job_id, True, entry.plan.nbytes, entry.seconds())
            except Exception as exc:
                result = JobResult(job_id, False, error=_describe(exc))
            del self._inflight[job_id]
            self._book.finish(result)


def _describe(exc: BaseException | None) -> str:
    if isinstance(exc, JobRejected):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"
