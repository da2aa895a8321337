"""The connector's scheduler role: vLLM's scheduler calls mapped onto kvoffload's
scheduler half (one per engine; no tensors)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

from kvoffload.adapters.prometheus import MetricsEndpoint
from kvoffload.adapters.vllm.announcements import Announcements
from kvoffload.adapters.vllm.compat import (
    CacheHitSource,
    KVCacheBlocks,
    KVCacheConfig,
    KVCacheEvent,
    KVConnectorOutput,
    Request,
    SchedulerOutput,
    VllmConfig,
)
from kvoffload.adapters.vllm.event_sink import EventSink, find_scheduler
from kvoffload.adapters.vllm.geometry import NULL_BLOCK, Geometry, derive_geometry
from kvoffload.adapters.vllm.guard import Guard
from kvoffload.adapters.vllm.hit_sources import hit_sources
from kvoffload.adapters.vllm.link_metrics import LinkCounters
from kvoffload.adapters.vllm.messages import PlanMetadata, ReportMetadata
from kvoffload.adapters.vllm.paused_reset import paused_scheduler
from kvoffload.adapters.vllm.scheduler_weights import SchedulerWeights
from kvoffload.adapters.vllm.startup import scheduler_summary
from kvoffload.adapters.vllm.stats import DeltaSource, KVOffloadStats
from kvoffload.core.config.typed import OffloadConfig
from kvoffload.core.identity.weights import WeightsState
from kvoffload.core.observe.anomalies import Anomaly
from kvoffload.core.observe.metrics import Series
from kvoffload.core.observe.metrics_view import MetricsReading, read_metrics
from kvoffload.core.scheduler.block_tables import flat
from kvoffload.core.scheduler_types import ScheduledRequest, StepInput
from kvoffload.core.tiering.lower import LowerTier
from kvoffload.tiers.build import EngineTiers, build_scheduler, open_engine_tiers
from kvoffload.tiers.node_shares import OpenedShare
from kvoffload.tiers.spec import OpenedIndex

logger = logging.getLogger("kvoffload")


def per_group(blocks: tuple[list[int], ...] | None) -> tuple[tuple[int, ...], ...]:
    """vLLM's block ids per KV cache group as kvoffload's tuples (None: none)."""
    return tuple(tuple(group) for group in blocks) if blocks else ()


def step_input(output: SchedulerOutput) -> StepInput:
    """kvoffload's view of one vLLM scheduling step (every KV cache group)."""
    counts = output.num_scheduled_tokens
    scheduled = [
        ScheduledRequest(
            new.req_id,
            new.num_computed_tokens,
            counts.get(new.req_id, 0),
            per_group(new.block_ids),
            replace=True,
        )
        for new in output.scheduled_new_reqs
    ]
    cached = output.scheduled_cached_reqs
    for i, request_id in enumerate(cached.req_ids):
        scheduled.append(
            ScheduledRequest(
                request_id,
                cached.num_computed_tokens[i],
                counts.get(request_id, 0),
                per_group(cached.new_block_ids[i]),
                replace=request_id in cached.resumed_req_ids,
            )
        )
    return StepInput(tuple(scheduled), tuple(sorted(output.preempted_req_ids or ())))


class SchedulerSide:
    """Owns the scheduler half, its directories and its observability for one engine.

    Every entry point holds ``lock``, so the metrics endpoint's thread reads a
    consistent state between engine calls, and runs under the :class:`Guard`: no
    exception reaches vLLM (the first turns offloading off, see ``guard.py``).

    It opens every tier through the build (``tiers/build.py``: host memory's
    directory and the lower tiers' indexes, each in the engine or in a node process
    over a backing) and owns them (``tiers``) until :meth:`shutdown`: a tier may hold
    a lock from then on (the disk tier refuses a second engine of the same model on
    the same ``disk_path`` with a ``ConfigError``). A failed construction closes every
    tier it opened. When a node process keeps any tier's directory, every plan's
    metadata names the engine's session there (``session``), for the workers' leases,
    and, with a host share, the slab its bookings are in.
    """

    def __init__(
        self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, config: OffloadConfig
    ) -> None:
        self.lock = threading.RLock()
        self.geometry: Geometry = derive_geometry(vllm_config, kv_cache_config, config)
        g = self.geometry
        self.tiers: EngineTiers = open_engine_tiers(
            config,
            g.namespace,
            world_size=g.world_size,
            chunk_bytes=g.chunk_sizes,
            slots={"host": g.num_slots, **g.tier_slots},
            groups=len(g.kv_groups),
        )
        self.session = self.tiers.session
        try:
            self._open(vllm_config, config)
        except BaseException:
            self.tiers.close()
            raise

    def _open(self, vllm_config: VllmConfig, config: OffloadConfig) -> None:
        g = self.geometry
        self.scheduler = build_scheduler(
            g.scheduler_config(config),
            self.tiers.host.index,
            g.namespace,
            self.tiers.lower.indexes,
            spill_after_hits=config.spill_after_hits,
            weights=WeightsState(g.world_size),  # the workers report their fingerprints
        )
        self.weights = SchedulerWeights(self.scheduler)  # decision 0019
        self.chunk_bytes = g.chunk_bytes * g.world_size  # one chunk, all workers
        self.chunk_sizes = {t: n * g.world_size for t, n in g.chunk_sizes.items()}
        self.raw_chunk_bytes = g.raw_chunk_bytes * g.world_size
        host_share = self.tiers.host_share
        self.link_counters = (
            LinkCounters(self.scheduler.metrics) if host_share is not None else None
        )
        self.deltas = DeltaSource(self.read_metrics, self._take_observations)
        self.sink = EventSink(find_scheduler())  # vLLM's scheduler is building us now
        self.events: Announcements | None = None  # vLLM's KV events on: announcements.py
        events = vllm_config.kv_events_config
        if events is not None and events.enable_kv_cache_events:
            shares = self.tiers.shares if config.share_announce_ms > 0 else {}
            logs = self.tiers.lower.record_logs()
            self.events = Announcements(
                self.scheduler.config,
                self.sink,
                {tier: opened.feed_reader() for tier, opened in shares.items()},
                {tier: log for tier, log in logs.items() if tier not in shares},
                held=self._held_events,
                interval_s=max(config.share_announce_ms, 1) / 1000,
                hash_algo=vllm_config.cache_config.prefix_caching_hash_algo,
            )
        self.config = config
        self.guard = Guard(self.scheduler)
        self.endpoint: MetricsEndpoint | None = None
        if config.metrics_port is not None:
            self.endpoint = MetricsEndpoint(self.read_metrics, config.metrics_port)

    def _held_events(self) -> list[KVCacheEvent]:
        """What the private tiers hold (the announcer's refreshes; any thread)."""
        with self.lock:
            return self.events.held_events() if self.events is not None else []

    @property
    def share(self) -> OpenedShare | None:
        """The host tier's node share (None: private host memory)."""
        return self.tiers.host_share

    def lower_tier(self, name: str) -> LowerTier | None:
        """The scheduler half's index of tier ``name`` (None: the tier is off)."""
        return self.tiers.lower.index(name)

    def replace_lower_tier(self, opened: OpenedIndex[LowerTier]) -> None:
        """Swap in ``opened`` for the open tier of its name (harnesses: an index in
        logical time), before the first step; the old one is closed."""
        name = opened.index.name
        self.tiers.lower.replace(name, opened)
        self.scheduler.tiers.replace(opened.index)

    def summary(self, load_failure_policy: str) -> str:
        """The scheduler role's start-up line (``startup.scheduler_summary``)."""
        g = self.geometry
        line = scheduler_summary(
            self.config,
            chunk_tokens=g.block_size * g.blocks_per_chunk,
            chunk_bytes=self.chunk_bytes,
            world_size=g.world_size,
            host_chunks=self.scheduler.directory.num_slots,
            tier_chunks=g.tier_slots,
            load_failure_policy=load_failure_policy,
            codecs={t: g.tier_codec(t) for t in self.chunk_sizes},
            chunk_sizes=self.chunk_sizes,
            raw_chunk_bytes=self.raw_chunk_bytes,
        )
        shares = [share.describe() for share in self.tiers.shares.values()]
        return ", ".join([line, *shares])

    def bind_block_pool(self, pool: object) -> None:
        """vLLM's block pool: a reset of its prefix cache starts a weights check."""
        with self.lock:
            self.weights.bind_pool(pool)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        with self.lock:
            if self.guard.off:
                return 0, False
            try:
                self.weights.watch()
                tokens = self.scheduler.lookup(request, num_computed_tokens)
            except Exception as exc:
                self.guard.trip("get_num_new_matched_tokens", exc)
                return 0, False
        if tokens is None:
            return None, False
        return tokens, tokens > 0

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        block_ids = blocks.get_block_ids()
        with self.lock:
            if not self.guard.off:
                try:
                    self.scheduler.on_allocated(request, block_ids, num_external_tokens)
                    return
                except Exception as exc:
                    self.guard.trip("update_state_after_alloc", exc)
            if num_external_tokens:
                owed = [b for b in flat(block_ids) if b != NULL_BLOCK]
                self.guard.owe(request.request_id, owed)

    def hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        """vLLM's per-source split of the hit just allocated (asked right after
        :meth:`update_state_after_alloc`): each tier's share of the request's load
        (``hit_sources.py``); all of it as host memory if kvoffload is off or the load
        is not found, so the counts always sum to ``num_external_tokens``."""
        if num_external_tokens <= 0:
            return {}
        with self.lock:
            if not self.guard.off:
                try:
                    by_tier = self.scheduler.load_sources(request.request_id, num_external_tokens)
                    if by_tier:
                        return hit_sources(by_tier)
                except Exception as exc:
                    self.guard.trip("get_external_cache_hit_sources", exc)
        return {CacheHitSource.HOST: num_external_tokens}

    def build_connector_meta(self, output: SchedulerOutput) -> PlanMetadata:
        with self.lock:
            if not self.guard.off:
                try:
                    if self.weights.watch() and self.events is not None:
                        self.events.prefix_cache_cleared()
                    plan = self.scheduler.build_plan(step_input(output))
                    if self.events is not None:
                        self.events.note_plan(plan, self.scheduler.state_of)
                    return PlanMetadata(
                        plan,
                        self.session,
                        weights=self.scheduler.weights.stamp(),
                        slab_id=self._slab_id(),
                        loras=self.weights.lora_stamp(plan),
                    )
                except Exception as exc:
                    self.guard.trip("build_connector_meta", exc)
            return PlanMetadata(self.guard.plan(), self.session, slab_id=self._slab_id())

    def _slab_id(self) -> bytes | None:
        """The host share's slab the plan just built moves bytes of (None: a private
        host tier); the next plan's bookings are bound to the node process now."""
        share = self.tiers.host_share
        return share.seal_plan() if share is not None else None

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        meta = output.kv_connector_worker_meta
        if not isinstance(meta, ReportMetadata):
            return
        with self.lock:
            if self.guard.off:
                return
            try:
                self._check_namespaces(meta.namespaces)
                self.weights.learn(meta.weights, meta.loras)
                for report in meta.reports:
                    done = self.scheduler.on_report(report)
                    if self.events is not None:
                        self.events.note_completed(c.job for c in done)
            except Exception as exc:
                self.guard.trip("update_connector_output", exc)

    def _check_namespaces(self, announced: tuple[tuple[int, bytes], ...]) -> None:
        """Every worker must key its lower-tier copies under this engine's namespace.
        A worker whose model load changed the configuration it digests (a model
        implementation that edits its HF config while building) derives another one:
        its copies in the lower tiers then never verify here (counted misses, never
        data). Counted and logged once, naming both digests."""
        own = self.geometry.namespace.digest()
        for rank, digest in announced:
            if digest != own:
                self.scheduler.anomalies.note(
                    Anomaly.NAMESPACE_MISMATCH,
                    f"worker rank {rank} derived namespace {digest.hex()}, the scheduler "
                    f"{own.hex()}: its lower tiers' copies will not be found (the model's "
                    "configuration differs between the processes)",
                )

    def handshake(self, metadata: Iterable[object]) -> None:
        """vLLM's handshake, before the first step (the workers' fingerprints)."""
        with self.lock:
            if self.guard.off:
                return
            try:
                self.weights.handshake(metadata)
            except Exception as exc:
                self.guard.trip("set_xfer_handshake_metadata", exc)

    def request_finished(self, request: Request) -> None:
        with self.lock:
            if self.guard.off:
                return
            try:
                self.scheduler.on_finished(request.request_id)
            except Exception as exc:
                self.guard.trip("request_finished", exc)

    def has_pending_work(self) -> bool:
        with self.lock:
            if self.guard.off:
                return False
            try:
                return self.scheduler.has_pending_work()
            except Exception as exc:
                self.guard.trip("has_pending_push_work", exc)
                return False

    def reset_cache(self) -> bool:
        """vLLM's connector reset. While vLLM's scheduler is paused (sleep, a pause with
        ``clear_cache``: ``paused_reset.py``) every tier is kept and the workers check
        their weights (changed weights move the keys, decision 0019); otherwise
        everything stored before is forgotten (decision 0005). Always True."""
        paused = paused_scheduler()
        with self.lock:
            if not self.guard.off:
                try:
                    if paused:
                        self.scheduler.check_weights()
                        self.scheduler.metrics.count("paused_resets_total")
                    else:
                        self.scheduler.reset()
                except Exception as exc:
                    self.guard.trip("reset_cache", exc)
        return True

    def take_events(self) -> list[KVCacheEvent]:
        """vLLM KV events for what changed in any tier (empty when vLLM's KV events
        are off; kvoffload's own events are drained either way), then the share
        announcements that waited for a step (``event_sink.py``)."""
        with self.lock:
            if self.guard.off:
                return []
            try:
                events = self.scheduler.take_events()
                return self.events.take(events) if self.events is not None else []
            except Exception as exc:
                self.guard.trip("take_events", exc)
                return []

    def read_metrics(self, with_gauges: bool = True) -> MetricsReading:
        with self.lock:
            share = self.tiers.host_share
            if share is not None and self.link_counters is not None:
                self.link_counters.sync(share.link_stats())
            return read_metrics(
                self.scheduler, self.chunk_sizes, raw_chunk_bytes=self.raw_chunk_bytes,
                with_gauges=with_gauges,
            )  # fmt: skip

    def _take_observations(self) -> dict[Series, list[float]]:
        with self.lock:
            return self.scheduler.metrics.take_observations()

    def connector_stats(self) -> KVOffloadStats | None:
        """The metrics delta since the previous call (vLLM's stats path), or None."""
        try:
            data = self.deltas.delta()
        except Exception as exc:
            with self.lock:
                self.guard.trip("get_kv_connector_stats", exc)
            return None
        return KVOffloadStats(data=data) if data else None

    def shutdown(self) -> None:
        if self.events is not None:
            self.events.close()
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None
        self.tiers.close()  # a share's node process keeps running
