"""The connector's worker role: vLLM's calls onto kvoffload's step runner.

The plan of each step runs on a :class:`~kvoffload.core.step_runner.StepRunner` over
a :class:`~kvoffload.transfer.step_backend.TransferBackend` (the copy worker, the tier
lane and, with a lower tier, the staging areas of tier loads, opened with the KV
caches). vLLM's calls, in its order, map onto it:
``handle_preemptions`` (before the forward pass) flushes (the runner's first part of
a step); ``start_load_kv`` (before or, for asynchronous loads, right after the
forward pass is launched) begins the step: the loads and tier jobs; ``wait_for_save``
(after the forward pass) ends the forward pass: the remaining stores, which capture
what this step computed; ``get_finished`` collects: finished loads are reported by
request id, failed loads' blocks (and the invalid blocks a load names) as invalid
(so vLLM recomputes them; with anything but one full-attention KV cache group the
failed requests instead, through ``get_transfer_results``' ``failed_recving``: see
:class:`TransferBackend`), and every result goes back to the scheduler half in the
worker metadata. Before ``register_kv_caches`` every per-step call is a no-op.
``unregister_kv_caches`` / ``restore_kv_caches`` (vLLM's sleep mode) fence and drain
the copies into and out of engine memory and map it again (``sleep_state.py``). The
loads and stores of a request whose LoRA adapter is not the one its keys name are
refused (``worker_loras.py``, decision 0025). Nothing here raises for a failed copy.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

import torch

from kvoffload.adapters.vllm.compat import KVCacheConfig, VllmConfig, tensor_parallel_rank
from kvoffload.adapters.vllm.geometry import Geometry, derive_geometry
from kvoffload.adapters.vllm.messages import PlanMetadata, ReportMetadata
from kvoffload.adapters.vllm.sleep_state import WorkerSleep
from kvoffload.adapters.vllm.startup import worker_summary
from kvoffload.adapters.vllm.worker_loras import WorkerLoras
from kvoffload.adapters.vllm.worker_weights import WorkerWeights
from kvoffload.codecs.chunk_codec import open_kv_codec
from kvoffload.core.config.typed import OffloadConfig
from kvoffload.core.errors import ConfigError
from kvoffload.core.identity.weights import FENCED
from kvoffload.core.jobs import JobResult, TransferJob, WorkerReport
from kvoffload.core.step_runner import StepRunner
from kvoffload.tiers.build import enabled_tiers, open_host_slots, open_tier_stores
from kvoffload.tiers.host_shared import SharedHostSlab
from kvoffload.tiers.slot_rows import SlotRows
from kvoffload.tiers.spec import SessionHolder
from kvoffload.transfer import CopyHook, TransferWorker
from kvoffload.transfer.cpu_kernel import NATIVE
from kvoffload.transfer.staged_loads import StagedLoadLane, StagedLoads
from kvoffload.transfer.step_backend import TransferBackend
from kvoffload.transfer.tier_codecs import through_codecs
from kvoffload.transfer.tier_worker import TierLane, TierStore, TierWorker

logger = logging.getLogger("kvoffload")


class WorkerSide:
    """One worker's connector role. Owns the step runner and, through its backend,
    the transfer worker (with the host slab), the tier lane and the staged loads
    (with their staging slabs: none without a lower tier); ``copy_hook``,
    ``rank_override``, ``clock`` (of the tier I/O deadlines) and ``io_hook`` (called
    before each tier call) are set by tests and harnesses before
    ``register_kv_caches``. Its host slots and lower tiers' stores are opened by the
    build (``tiers/build.py``); a store kept by a node process (a host share's slab:
    ``share``) holds a lease on the session every plan names before running the
    plan's jobs, and a host share's slab is checked against the slab the plan names."""

    def __init__(
        self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, config: OffloadConfig
    ) -> None:
        self.geometry: Geometry = derive_geometry(vllm_config, kv_cache_config, config)
        self.config = config
        self.share: SharedHostSlab | None = None  # from register_kv_caches on, with a host share
        self._session_stores: list[SessionHolder] = []  # stores booked at a node process
        self.copy_hook: CopyHook | None = None  # tests: hold or fail copies
        self.rank_override: int | None = None  # harnesses running several ranks in one process
        self.rank = 0
        self.runner: StepRunner[TransferBackend] | None = None  # from register_kv_caches on
        self._results: list[JobResult] = []  # polled, not yet sent to the scheduler half
        self._announced = False  # this worker's namespace sent to the scheduler half
        self._released: list[int] = []  # likewise: timed-out tier jobs whose I/O returned
        self.clock: Callable[[], float] = time.monotonic  # tier I/O deadlines (harnesses)
        self.io_hook: Callable[[TransferJob], None] | None = None  # tests: hang tier I/O
        self._invalid_blocks: set[int] = set()
        # The weights' identity (decision 0019); harnesses set ``weights.source``.
        self.weights = WorkerWeights()
        self.loras = WorkerLoras()  # the LoRA adapters vLLM loaded (decision 0025)
        # Whether this connector is the engine's own (not a MultiConnector's child):
        # None asks vLLM; harnesses set it.
        self.top_level: bool | None = None
        self.sleep = WorkerSleep()  # vLLM's sleep mode (decision 0021)
        self._kv_caches: dict[str, torch.Tensor] = {}  # as registered, for restore
        self._staging: StagedLoads | None = None  # the tier loads' copiers, if any
        self._weights_refusal: str | None = None  # the weights fence of the last plan

    @property
    def worker(self) -> TransferWorker | None:
        """The transfer worker (None before ``register_kv_caches``)."""
        return self.runner.backend.worker if self.runner is not None else None

    @property
    def tiers(self) -> TierLane | None:
        """The tier lane (None before ``register_kv_caches`` or without a tier)."""
        return self.runner.backend.tiers if self.runner is not None else None

    @property
    def staged(self) -> StagedLoadLane | None:
        """The tier loads' staged lanes (None before ``register_kv_caches`` or
        without a tier)."""
        return self.runner.backend.staged if self.runner is not None else None

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Open the transfer worker over ``kv_caches`` and the configured tiers, and
        the step runner over them. Raises ConfigError for a KV layout whose chunks
        are not the size the KV cache config implies, or a tier that refuses to open
        (its spec's ``open_store``: e.g. a namespace another engine holds); nothing is
        left open then."""
        if self.rank_override is not None:
            self.rank = self.rank_override
        else:
            try:
                self.rank = tensor_parallel_rank()
            except (AssertionError, RuntimeError):
                self.rank = 0  # no distributed environment: a single worker
        self.weights.open(self.rank)
        self.loras.open(self.rank, self.weights.runner())
        worker = self._open_worker(kv_caches)
        tiers: TierWorker | None = None
        try:
            tiers = self._open_tiers(worker, {t.dtype for t in kv_caches.values()})
            staged = None
            if tiers is not None:
                staged = StagedLoads.open(
                    worker,
                    tiers.stores,
                    timeout_s=self.config.tier_io_timeout_ms / 1000,
                    clock=self.clock,
                    io_hook=self.io_hook,
                )
        except BaseException:
            if tiers is not None:
                tiers.shutdown()
            worker.shutdown()
            raise
        self._kv_caches, self._staging = dict(kv_caches), staged
        groups = self.geometry.kv_groups
        backend = TransferBackend(
            worker,
            tiers,
            wait_for_loads=self.copy_hook is None,
            fail_by_request=not groups.single or groups.windowed,
            staged=staged,
        )
        self.runner = StepRunner(backend)
        logger.info("%s", self._summary(worker, tiers))

    def _open_slab(self, chunk_bytes: int) -> SlotRows:
        """This rank's host slots, for chunks of ``chunk_bytes`` (the registered KV
        tensors'): ConfigError when those are not the KV cache config's, or the host
        share refuses them."""
        g = self.geometry
        if chunk_bytes != g.chunk_bytes:
            raise ConfigError(
                "kv_caches",
                f"the registered KV tensors hold {chunk_bytes} bytes per chunk, the KV "
                f"cache config {g.chunk_bytes}: unsupported layout",
            )
        slab = open_host_slots(
            self.config, g.namespace, rank=self.rank, world_size=g.world_size,
            chunk_bytes=chunk_bytes, slots=g.num_slots,
        )  # fmt: skip
        if isinstance(slab, SharedHostSlab):
            self.share = slab
        if isinstance(slab, SessionHolder):
            self._session_stores.append(slab)
        return slab

    def _open_worker(self, kv_caches: Mapping[str, torch.Tensor]) -> TransferWorker:
        g = self.geometry
        return TransferWorker.for_kv_caches(
            kv_caches,
            g.num_blocks,
            blocks_per_chunk=g.blocks_per_chunk,
            host_budget_bytes=g.host_bytes_per_worker,
            threads=self.config.copy_threads,
            rank=self.rank,
            hook=self.copy_hook,
            open_slab=self._open_slab,
            codec=g.codec,
        )

    def _summary(self, worker: TransferWorker, tiers: TierWorker | None) -> str:
        layout = worker.layout
        if layout.device.type == "cuda":
            copy_path = "CUDA copy engine"
        elif NATIVE:
            copy_path = f"compiled kernel, {self.config.copy_threads} thread(s)"
        else:
            copy_path = "numpy (slower)"
            logger.warning(
                "kvoffload: the compiled copy kernel is missing (built at install time "
                "with a C compiler); copies use numpy and are slower"
            )
        if tiers is not None:
            for spec in enabled_tiers(self.config):
                spec.worker_notes(self.config, tiers.stores[spec.name])
        line = worker_summary(
            rank=self.rank,
            world_size=self.geometry.world_size,
            layers=layout.num_layers,
            device=str(layout.device),
            slab_bytes=worker.slab.num_slots * worker.slab.chunk_bytes,
            slots=worker.slab.num_slots,
            copy_path=copy_path,
            tiers=sorted(tiers.stores) if tiers is not None else [],
        )
        return line if self.share is None else f"{line}, {self.share.describe()}"

    def _open_tiers(self, worker: TransferWorker, dtypes: set[torch.dtype]) -> TierWorker | None:
        g, config = self.geometry, self.config
        stores: dict[str, TierStore] = open_tier_stores(
            config,
            g.namespace,
            rank=self.rank,
            world_size=g.world_size,
            chunk_bytes=g.chunk_sizes,
            slots=g.tier_slots,
            groups=len(g.kv_groups),
        )
        self._session_stores += [s for s in stores.values() if isinstance(s, SessionHolder)]
        raw = g.raw_chunk_bytes
        for name, store in stores.items():  # each tier's codec (decision 0023)
            tier = open_kv_codec(g.tier_codec(name), dtypes, raw, f"{name}_codec")
            keyed = g.tier_slots.get(name, 0) == 0
            stores[name] = through_codecs(store, worker.codec, tier, raw_bytes=raw, keyed=keyed)
        if not stores:
            return None
        return TierWorker(
            worker.slab,
            stores,
            threads=config.tier_threads,
            timeout_s=config.tier_io_timeout_ms / 1000,
            clock=self.clock,
            io_hook=self.io_hook,
        )

    # ------------------------------------------------------------ per step

    def handle_preemptions(self, metadata: PlanMetadata) -> None:
        """Before the forward pass: the step's flush (its first call: idempotent)."""
        self._prepare(metadata)
        if self.runner is not None:
            self.runner.flush(metadata.plan)

    def start_load_kv(self, metadata: PlanMetadata) -> None:
        """Submit the step's loads, spills and promotions (after the flush)."""
        self._prepare(metadata)
        if self.runner is not None:
            self.runner.begin_step(metadata.plan)

    def wait_for_save(self, metadata: PlanMetadata) -> None:
        """After the forward pass: submit the step's remaining stores."""
        self._prepare(metadata)
        if self.runner is not None:
            self.runner.flush(metadata.plan)
            self.runner.end_forward()

    def _prepare(self, metadata: PlanMetadata) -> None:
        """Before any job of the plan runs: hold its session, fingerprint the weights
        when the plan asks for a new check or they were loaded anew, and fence the
        plan's loads and stores unless this worker's weights are the ones its keys
        name (decision 0019), and those of requests whose LoRA adapter is not the one
        their keys name (decision 0025)."""
        self._hold_session(metadata)
        stamp = metadata.weights
        if self.runner is None:
            return
        asleep = self.sleep.refusal
        if stamp is not None and asleep is None:  # never fingerprint released weights
            self._weights_refusal = None if self.weights.admits(stamp) else FENCED
        self.runner.backend.refusal = asleep or self._weights_refusal
        refused = self.loras.refused(metadata.loras, metadata.plan)
        self.runner.backend.refused_requests = dict.fromkeys(refused, FENCED)

    # ------------------------------------------------------------ sleep mode

    def _copiers(self) -> list[tuple[TransferWorker, bool]]:
        """The copiers that touch engine blocks, each with whether this thread collects
        its copies (a staging worker's lane thread collects its own)."""
        if self.runner is None:
            return []
        pairs = [(self.runner.backend.worker, True)]
        if self._staging is not None:
            pairs += [(w, False) for w in self._staging.staging_workers.values()]
        return pairs

    def unregister_kv_caches(self) -> None:
        """vLLM is about to release the KV cache memory: fence and drain every copy that
        touches it (``sleep_state.py``). Idempotent; never raises."""
        running = self._staging.running() if self._staging is not None else set()
        self.sleep.unregister(self._copiers(), running)

    def restore_kv_caches(self) -> None:
        """The KV cache memory is back: map it again and lift the fence. Idempotent;
        never raises."""
        self.sleep.restore(self._copiers(), self._kv_caches)

    def _hold_session(self, metadata: PlanMetadata) -> None:
        """Lease the session the plan names before any of its jobs run, at every store
        booked by a node process (a host share's slab, a shared disk's); with a host
        share, check that this worker's slab is the one the plan names (remapped if
        the share's files were made anew and nothing is in flight on the old one),
        else the plan's jobs that touch host slots fail (``SharedHostSlab.admit``)."""
        for store in self._session_stores:
            store.hold(metadata.session)
        if self.share is not None and self.runner is not None:
            backend = self.runner.backend
            backend.host_refusal = self.share.admit(metadata.slab_id, backend.host_busy)

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        """Collect results: (None, ids of the requests whose load finished or failed,
        None when there are none). The results wait for the worker metadata."""
        if self.runner is None:
            return None, None
        for report in self.runner.collect():
            self._results.extend(report.results)
            self._released.extend(report.released)
        backend = self.runner.backend
        self._invalid_blocks.update(backend.take_invalid_blocks())
        return None, backend.take_loaded() or None

    def take_failed(self) -> set[str]:
        """Requests whose load failed since the last call, when failures are reported
        by request (see :class:`TransferBackend`; ``get_finished`` reports them too)."""
        return self.runner.backend.take_failed() if self.runner is not None else set()

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid_blocks = self._invalid_blocks, set()
        return invalid

    def build_connector_worker_meta(self) -> ReportMetadata | None:
        """This step's report; the first one also names the namespace this worker
        derived (its model configuration as it loaded the model), for the scheduler
        half to check against its own, and every report the weights' fingerprints
        taken since the last one (decision 0019)."""
        announce = () if self._announced else ((self.rank, self.geometry.namespace.digest()),)
        weights, loras = self.weights.take_reports(), self.loras.take_reports()
        if not (self._results or self._released or announce or weights or loras):
            return None
        self._announced = True
        results, self._results = tuple(self._results), []
        released, self._released = tuple(self._released), []
        report = WorkerReport(self.rank, results, released)
        return ReportMetadata((report,), announce, weights, loras)

    def shutdown(self) -> None:
        """Shut the staged loads, the tier lane (which closes the tier stores the
        staged loads read) and the transfer worker down (never raises)."""
        if self.staged is not None:
            self.staged.shutdown()
        if self.tiers is not None:
            self.tiers.shutdown()
        if self.worker is not None:
            self.worker.shutdown(timeout=10.0)
        if self.share is not None:  # after the copies: the lease covers them
            self.share.close()
            self.share = None
