"""The results of a run of several replicas: per replica, in total, and host memory.

The total is a :class:`~kvoffload.simulate.report.SimResult` over every request (its
report and JSON are a one-engine run's, with the host tier as a whole: the shared
one, or the private ones summed). Besides it, per replica: requests, hit rates and
time to first token (mean, p50, p99); and host memory:

- **used at peak**: the most host slots in use at once (stores in flight included),
  the shared tier's or the private tiers' together, in bytes;
- **extra copies** (private tiers): chunks held readable in more than one replica's
  tier, each counted once less than its copies, at most at once and at the end: memory
  one shared tier of the same size holds distinct chunks in instead;
- **stores spared** (shared tier): chunks a replica offered to store that another
  replica held already (``present``) or was storing (``storing``), each counted once
  per replica; the share copied them once, where each replica's private tier would
  have written (and held) a copy of its own.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvoffload.simulate.report import GroupResult, SimResult, TierResult, format_report
from kvoffload.simulate.units import format_bytes

if TYPE_CHECKING:
    from kvoffload.simulate.host_ledger import HostLedger, SharedHost
    from kvoffload.simulate.routing import ReplicaSetup
    from kvoffload.simulate.runner import Simulation
    from kvoffload.simulate.settings import SimConfig


@dataclass(frozen=True)
class ReplicaRow:
    """One replica's requests, hits (prompt tokens at first admission) and TTFTs."""

    requests: int
    prompt_tokens: int
    engine_hit_tokens: int
    kvoffload_hit_tokens: int
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    host_stored_chunks: int
    stores_spared: int

    @property
    def total_hit_rate(self) -> float:
        hits = self.engine_hit_tokens + self.kvoffload_hit_tokens
        return hits / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def hit_rate(self) -> float:
        return self.kvoffload_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass
class ReplicasResult:
    """A run of ``replicas`` engines (module docstring); sizes in chunks of
    :attr:`host_chunk_bytes` (encoded by the host's codec)."""

    replicas: int
    shared: bool
    route: str
    total: SimResult
    rows: list[ReplicaRow] = field(default_factory=list)
    ttft_p99_s: float = 0.0
    host_capacity_chunks: int = 0  # the shared tier's, or the private ones' together
    peak_used_chunks: int = 0
    extra_copies_max: int = 0
    extra_copies_at_end: int = 0
    distinct_at_end: int = 0
    spared_present: int = 0
    spared_storing: int = 0

    @property
    def host_chunk_bytes(self) -> int:
        """Bytes one chunk takes in host memory (encoded by its codec; without a host
        tier, the raw chunk's)."""
        host = self.total.tier("host")
        return host.codec.chunk_bytes if host is not None else self.total.chunk_bytes

    def as_json(self) -> dict[str, Any]:
        out = self.total.as_json()
        cb = self.host_chunk_bytes
        out["replicas"] = {
            "replicas": self.replicas,
            "host_share": self.shared,
            "route": self.route,
            "ttft_p99_s": self.ttft_p99_s,
            "host_capacity_bytes": self.host_capacity_chunks * cb,
            "host_peak_used_bytes": self.peak_used_chunks * cb,
            "extra_copies_max_bytes": self.extra_copies_max * cb,
            "extra_copies_at_end_bytes": self.extra_copies_at_end * cb,
            "distinct_chunks_at_end": self.distinct_at_end,
            "stores_spared_present": self.spared_present,
            "stores_spared_storing": self.spared_storing,
            "stores_spared_bytes": (self.spared_present + self.spared_storing) * cb,
            "per_replica": [
                {
                    "requests": row.requests,
                    "prompt_tokens": row.prompt_tokens,
                    "engine_hit_tokens": row.engine_hit_tokens,
                    "kvoffload_hit_tokens": row.kvoffload_hit_tokens,
                    "hit_rate": row.hit_rate,
                    "total_hit_rate": row.total_hit_rate,
                    "ttft_mean_s": row.ttft_mean_s,
                    "ttft_p50_s": row.ttft_p50_s,
                    "ttft_p99_s": row.ttft_p99_s,
                    "host_stored_chunks": row.host_stored_chunks,
                    "stores_spared": row.stores_spared,
                }
                for row in self.rows
            ],
        }
        return out


def _ttfts(sim: Simulation) -> list[float]:
    return sorted(ttft for _, ttft in sim.arrived)


def _sum_dicts(parts: list[dict[str, int]]) -> dict[str, int]:
    total: Counter[str] = Counter()
    for part in parts:
        total.update(part)
    return dict(total)


def _merge_groups(parts: list[GroupResult | None]) -> GroupResult | None:
    groups = [g for g in parts if g is not None]
    if not groups:
        return None
    first = groups[0]
    return GroupResult(
        first.kinds,
        first.pool_blocks,
        first.request_capacity,
        peak_blocks=max(g.peak_blocks for g in groups),
        peak_context_tokens=max(g.peak_context_tokens for g in groups),
        stored=[sum(n) for n in zip(*(g.stored for g in groups), strict=True)],
        loaded=[sum(n) for n in zip(*(g.loaded for g in groups), strict=True)],
    )


def _host_total(parts: list[SimResult], shared: SharedHost | None) -> list[TierResult]:
    hosts = [t for r in parts for t in r.tiers if t.tier == "host"]
    if not hosts:
        return []
    written, read = sum(t.written for t in hosts), sum(t.read for t in hosts)
    codec = hosts[0].codec
    if shared is not None:
        evictions = shared.metrics.value("evictions_total")
        return [TierResult("host", shared.num_slots, codec, written, read, evictions, len(shared))]
    return [
        TierResult(
            "host",
            sum(t.capacity_chunks for t in hosts),
            codec,
            written,
            read,
            sum(t.evictions for t in hosts),
            sum(t.held_at_end for t in hosts),
        )
    ]


def merge_results(
    config: SimConfig,
    setup: ReplicaSetup,
    sims: list[Simulation],
    shared: SharedHost | None,
    ledger: HostLedger,
) -> ReplicasResult:
    """The run's result from its finished replicas (``_finish`` called on each)."""
    from kvoffload.simulate.runner import fill_ttfts, percentile

    parts = [sim.result for sim in sims]
    total = SimResult(config.settings(), config.cost, config.chunk_bytes)
    for name in (
        "requests",
        "prompt_tokens",
        "output_tokens",
        "engine_hit_tokens",
        "kvoffload_hit_tokens",
        "readmissions",
        "readmission_hit_tokens",
        "computed_prefill_tokens",
        "decode_tokens",
        "deferral_timeouts",
        "preemptions",
        "engine_steps",
        "flush_stall_s",
    ):
        setattr(total, name, sum(getattr(r, name) for r in parts))
    # the shared directory counts into one scheduler half's recorder: read it once
    refusals = [r.admission_refusals for r in parts]
    total.admission_refusals = max(refusals) if shared is not None else sum(refusals)
    total.deferrals = _sum_dicts([r.deferrals for r in parts])
    total.declined_tokens = _sum_dicts([r.declined_tokens for r in parts])
    busy: Counter[str] = Counter()
    coding: Counter[str] = Counter()
    for r in parts:
        busy.update(r.lane_busy_s)
        coding.update(r.lane_codec_s)
    total.lane_busy_s = dict(busy)
    total.lane_codec_s = dict(coding)
    total.simulated_s = max(r.simulated_s for r in parts)
    total.tiers = _host_total(parts, shared)
    total.groups = _merge_groups([r.groups for r in parts])
    arrived = [pair for sim in sims for pair in sim.arrived]
    fill_ttfts(total, arrived)
    firsts = [sim.first_arrival for sim in sims if sim.first_arrival is not None]
    total.trace_span_s = max(sim.last_arrival for sim in sims) - min(firsts, default=0.0)
    rows = []
    for i, (sim, r) in enumerate(zip(sims, parts, strict=True)):
        ordered = _ttfts(sim)
        host = r.tier("host")
        spared = 0 if shared is None else shared.found_present[i] + shared.found_storing[i]
        rows.append(
            ReplicaRow(
                r.requests,
                r.prompt_tokens,
                r.engine_hit_tokens,
                r.kvoffload_hit_tokens,
                r.ttft_mean_s,
                r.ttft_p50_s,
                percentile(ordered, 0.99) if ordered else 0.0,
                host.written if host is not None else 0,
                spared,
            )
        )
    every = sorted(ttft for _, ttft in arrived)
    host_total = total.tier("host")
    return ReplicasResult(
        setup.replicas,
        setup.shared,
        setup.route,
        total,
        rows,
        ttft_p99_s=percentile(every, 0.99) if every else 0.0,
        host_capacity_chunks=host_total.capacity_chunks if host_total is not None else 0,
        peak_used_chunks=ledger.peak_used_slots,
        extra_copies_max=ledger.peak_extra,
        extra_copies_at_end=ledger.extra,
        distinct_at_end=ledger.distinct,
        spared_present=sum(shared.found_present) if shared is not None else 0,
        spared_storing=sum(shared.found_storing) if shared is not None else 0,
    )


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def format_replicas(r: ReplicasResult) -> str:
    """The one-engine report of the total, then the replicas and host memory."""
    cb = r.host_chunk_bytes
    host = "one shared host tier" if r.shared else f"{r.replicas} private host tiers"
    lines = [
        format_report(r.total),
        "",
        f"Replicas: {r.replicas}, {host} of {format_bytes(r.host_capacity_chunks * cb)} "
        f"in all, {r.route} routing",
        "  replica  requests  hit rate (engine + kvo)   kvo    TTFT mean      p50      p99"
        "   host stores  spared",
    ]
    for i, row in enumerate(r.rows):
        lines.append(
            f"  {i:>7}  {row.requests:>8}  {_pct(row.total_hit_rate):>23}  "
            f"{_pct(row.hit_rate):>6}  {row.ttft_mean_s:>9.3f} s {row.ttft_p50_s:>7.3f} "
            f"{row.ttft_p99_s:>8.3f}  {row.host_stored_chunks:>12}  {row.stores_spared:>6}"
        )
    t = r.total
    lines += [
        f"  {'all':>7}  {t.requests:>8}  {_pct(t.total_hit_rate):>23}  {_pct(t.hit_rate):>6}  "
        f"{t.ttft_mean_s:>9.3f} s {t.ttft_p50_s:>7.3f} {r.ttft_p99_s:>8.3f}",
        "",
        "Host memory",
        f"  used at peak              {format_bytes(r.peak_used_chunks * cb)} "
        f"({r.peak_used_chunks} chunks) of {format_bytes(r.host_capacity_chunks * cb)}",
    ]
    if r.shared:
        spared = r.spared_present + r.spared_storing
        lines.append(
            f"  stores spared             {spared} chunks ({format_bytes(spared * cb)}): "
            f"another replica held them ({r.spared_present}) or was storing them "
            f"({r.spared_storing}); each replica's private tier would have written its own copy"
        )
    else:
        lines.append(
            f"  extra copies              at most {r.extra_copies_max} chunks "
            f"({format_bytes(r.extra_copies_max * cb)}) at once, {r.extra_copies_at_end} at "
            "the end: chunks held by more than one private tier; one shared tier holds other "
            "chunks there"
        )
    return "\n".join(lines)
