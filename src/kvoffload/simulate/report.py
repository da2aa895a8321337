"""The simulator's results: numbers, derived rates, a printed table, JSON.

A :class:`SimResult` is plain data (one simulation); everything printed is derived
from its fields, so the table and the JSON cannot disagree.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from kvoffload.simulate.codecs import NONE, TierCodec
from kvoffload.simulate.cost import CostModel
from kvoffload.simulate.optimum import Bounds
from kvoffload.simulate.report_limits import behind_warning, is_behind, limit_lines
from kvoffload.simulate.units import format_bytes


@dataclass
class TierResult:
    """One tier's capacity and traffic in chunks, and its ``codec``: bytes are chunks
    times the tier's encoded chunk bytes (``codec.chunk_bytes``; the raw chunk's
    without a codec).

    ``written``: chunks copied into the tier (host: stores from the engine; a lower
    tier: spills from host memory). ``read``: chunks copied out of it (host: loads
    into the engine; a lower tier: promotions into host memory and tier loads' chunks
    read straight into the engine). ``evicted_without_copy`` (host, with a lower
    tier): evicted chunks no lower tier held."""

    tier: str
    capacity_chunks: int
    codec: TierCodec
    written: int = 0
    read: int = 0
    evictions: int = 0
    held_at_end: int = 0
    evicted_without_copy: int = 0


@dataclass
class GroupResult:
    """A hybrid engine's KV cache groups (None in a one-group run's result).

    ``kinds``: each group, ``full`` or ``window=N``. ``pool_blocks``: the engine's
    blocks, shared by the groups (the null block included); ``request_capacity``: the
    longest request it can hold (None: any). ``peak_blocks`` / ``peak_context_tokens``:
    the most blocks in use and the most context tokens running requests had computed,
    at the end of a step. ``stored`` / ``loaded``: host chunks per group."""

    kinds: list[str]
    pool_blocks: int
    request_capacity: int | None
    peak_blocks: int = 0
    peak_context_tokens: int = 0
    stored: list[int] = field(default_factory=list)
    loaded: list[int] = field(default_factory=list)

    def by_kind(self, counts: list[int]) -> tuple[int, int]:
        """(full groups' total, window groups' total) of per-group ``counts``."""
        full = sum(n for kind, n in zip(self.kinds, counts, strict=False) if kind == "full")
        return full, sum(counts) - full


@dataclass
class SimResult:
    settings: dict[str, Any]
    cost: CostModel
    chunk_bytes: int
    requests: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    engine_hit_tokens: int = 0  # first admissions: the engine's own prefix cache
    kvoffload_hit_tokens: int = 0  # first admissions: loaded from kvoffload
    readmissions: int = 0  # admissions after a preemption
    readmission_hit_tokens: int = 0  # loaded from kvoffload at those
    computed_prefill_tokens: int = 0  # prompt and recomputed positions actually computed
    decode_tokens: int = 0
    tiers: list[TierResult] = field(default_factory=list)
    deferrals: dict[str, int] = field(default_factory=dict)
    deferral_timeouts: int = 0
    declined_tokens: dict[str, int] = field(default_factory=dict)  # by tier, per lookup
    admission_refusals: int = 0
    preemptions: int = 0
    engine_steps: int = 0
    simulated_s: float = 0.0
    flush_stall_s: float = 0.0
    ttft_mean_s: float = 0.0
    ttft_p50_s: float = 0.0
    ttft_p95_s: float = 0.0
    lane_busy_s: dict[str, float] = field(default_factory=dict)
    lane_codec_s: dict[str, float] = field(default_factory=dict)  # of lane_busy_s, coding
    late_ttft_p50_s: float = 0.0  # median TTFT of the last tenth of requests (arrival)
    trace_span_s: float = 0.0  # last arrival - first arrival
    wall_s: float = 0.0
    groups: GroupResult | None = None  # several KV cache groups only
    bounds: Bounds | None = None  # the workload's limits at this host capacity

    # ------------------------------------------------------------------ derived

    @property
    def hit_rate(self) -> float:
        """Prompt tokens served from kvoffload / prompt tokens (first admissions)."""
        return self.kvoffload_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def engine_hit_rate(self) -> float:
        return self.engine_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def total_hit_rate(self) -> float:
        """Prompt tokens served by the engine's prefix cache or kvoffload / prompt
        tokens (first admissions): the figure the bounds limit."""
        return self.hit_rate + self.engine_hit_rate

    @property
    def share_of_optimum(self) -> float | None:
        """``total_hit_rate`` / the optimum's (None: no bounds, or an optimum of 0)."""
        b = self.bounds
        if b is None or not b.optimum_tokens:
            return None
        return (self.engine_hit_tokens + self.kvoffload_hit_tokens) / b.optimum_tokens

    @property
    def behind_trace(self) -> bool:
        """The engine fell behind the trace's arrivals (see
        :func:`~kvoffload.simulate.report_limits.is_behind`)."""
        return is_behind(self.late_ttft_p50_s, self.trace_span_s)

    @property
    def avoided_tokens(self) -> int:
        """Positions loaded from kvoffload instead of recomputed (every admission)."""
        return self.kvoffload_hit_tokens + self.readmission_hit_tokens

    def tier(self, name: str) -> TierResult | None:
        return next((t for t in self.tiers if t.tier == name), None)

    @property
    def load_s(self) -> float:
        """Copy time of what hits brought in (host loads, lower-tier promotions and
        tier loads' reads, as each lane moves them), and the CPU's decoding of it."""
        total = 0.0
        for t in self.tiers:
            lane = t.tier  # host memory's lane, or the lower tier's own
            each = t.codec.engine_link_bytes if lane == "host" else t.codec.chunk_bytes
            total += self.cost.copy_seconds(t.read * each, lane)
            total += t.codec.load_seconds(t.read)
        return total

    @property
    def saved_s(self) -> float:
        """Prefill seconds the avoided tokens would have cost."""
        return self.avoided_tokens * self.cost.prefill_s_per_token

    @property
    def stored_bytes_per_token(self) -> float:
        """Host bytes written per token position stored (by the group that stored the
        most chunks; with one group the model's bytes per token)."""
        host = self.tier("host")
        most = max(self.groups.stored, default=0) if self.groups is not None else 0
        if host is None or not most:
            return 0.0
        written = host.written * host.codec.chunk_bytes
        return written / (most * int(self.settings["chunk_tokens"]))

    def as_json(self) -> dict[str, Any]:
        out = asdict(self)
        if self.groups is None:
            del out["groups"]
        else:
            out["stored_bytes_per_token"] = self.stored_bytes_per_token
        del out["bounds"]
        b = self.bounds
        if b is not None:
            out.update(
                optimum_capacity_chunks=b.capacity_chunks,
                optimum_hit_rate=b.optimum_rate,
                infinite_hit_rate=b.infinite_rate,
                share_of_optimum=self.share_of_optimum,
            )
        out["cost"] = self.cost.as_dict()
        for t, tier in zip(out["tiers"], self.tiers, strict=True):
            t.update(
                codec=tier.codec.name,
                codec_ratio=tier.codec.ratio,
                chunk_bytes=tier.codec.chunk_bytes,  # encoded, as the tier holds it
            )
            for key in ("capacity", "written", "read"):
                count = t["capacity_chunks"] if key == "capacity" else t[key]
                t[f"{key}_bytes"] = count * tier.codec.chunk_bytes
                t[f"{key}_raw_bytes"] = count * self.chunk_bytes
        out.update(
            hit_rate=self.hit_rate,
            engine_hit_rate=self.engine_hit_rate,
            total_hit_rate=self.total_hit_rate,
            behind_trace=self.behind_trace,
            recompute_tokens_avoided=self.avoided_tokens,
            prefill_seconds_saved=self.saved_s,
            load_seconds=self.load_s,
            net_seconds_saved=self.saved_s - self.load_s,
        )
        return out


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def format_report(r: SimResult) -> str:
    """The human-readable report: assumptions, results, traffic per tier."""
    s, c = r.settings, r.cost
    warning = behind_warning(r.late_ttft_p50_s, r.trace_span_s)
    lines = [
        *([warning, ""] if warning else []),
        "Assumptions",
        f"  engine       {s['engine_tokens']} KV tokens, block {s['block_size']} tokens, "
        f"budget {s['token_budget']} tokens/step, {s['max_running']} running max, "
        f"prefix cache {'on' if s['prefix_caching'] else 'off'}",
        f"  kvoffload    host {format_bytes(s['cpu_bytes'])}, "
        + ", ".join(f"{n} {format_bytes(s[f'{n}_bytes'])}" for n in c.tier_gbps)
        + "; eviction "
        f"{s['eviction']}, store_threshold {s['store_threshold']}, lower_tier_admission "
        f"{s['lower_tier_admission']}, lower_tier_loads {s['lower_tier_loads']}, "
        f"load_policy {s['load_policy']}",
        *_chunk_lines(r),
        *_codec_lines(r),
        f"  cost model   prefill {c.prefill_s_per_token * 1e6:.0f} us/token, decode "
        f"{c.decode_s_per_token * 1e6:.0f} us/token (one step per {s['decode_stride']} tokens); "
        f"host {c.host_gbps:g} GB/s, "
        + ", ".join(f"{n} {gbps:g} GB/s" for n, gbps in c.tier_gbps.items()),
        "",
        "Results",
        f"  requests                  {r.requests}  ({r.prompt_tokens} prompt tokens, "
        f"{r.output_tokens} output tokens)",
        f"  kvoffload hit rate        {_pct(r.hit_rate)}  ({r.kvoffload_hit_tokens} prompt "
        "tokens loaded / prompt tokens)",
        f"  engine prefix-cache hits  {_pct(r.engine_hit_rate)}  ({r.engine_hit_tokens} tokens)",
        *limit_lines(r.engine_hit_tokens + r.kvoffload_hit_tokens, r.prompt_tokens, r.bounds),
        f"  recompute avoided         {r.avoided_tokens} tokens  (incl. "
        f"{r.readmission_hit_tokens} on {r.readmissions} re-admissions after preemption)",
        f"  prefill time saved        {r.saved_s:.1f} s, minus {r.load_s:.1f} s of loads = "
        f"{r.saved_s - r.load_s:.1f} s net",
        f"  prefill computed          {r.computed_prefill_tokens} tokens; decode "
        f"{r.decode_tokens} tokens",
        f"  simulated time            {r.simulated_s:.1f} s  ({r.engine_steps} engine steps, "
        f"{r.preemptions} preemptions, {r.flush_stall_s:.2f} s waiting for flushed stores)",
        f"  time to first token       mean {r.ttft_mean_s:.3f} s, p50 {r.ttft_p50_s:.3f} s, "
        f"p95 {r.ttft_p95_s:.3f} s",
        f"  deferrals                 {sum(r.deferrals.values())}"
        + "".join(f", {k} {v}" for k, v in sorted(r.deferrals.items()))
        + f"; timeouts {r.deferral_timeouts}; admission refusals {r.admission_refusals}",
        f"  hits recomputed (cost)    {sum(r.declined_tokens.values())} tokens"
        + "".join(f", {k} {v}" for k, v in sorted(r.declined_tokens.items())),
        *_group_results(r),
        "",
        "Traffic         capacity     written (stored/spilled)   read (loaded/promoted)  "
        " evictions   held at end",
    ]
    for t in r.tiers:
        cb = t.codec.chunk_bytes  # as the tier holds them: encoded
        lines.append(
            f"  {t.tier:<8} {format_bytes(t.capacity_chunks * cb):>11}  "
            f"{format_bytes(t.written * cb):>10} {t.written:>9} ch    "
            f"{format_bytes(t.read * cb):>10} {t.read:>9} ch  {t.evictions:>10}  "
            f"{t.held_at_end:>10}"
        )
    if any(t.codec.name != NONE for t in r.tiers):
        coding = ", ".join(f"{lane} {sec:.1f} s" for lane, sec in sorted(r.lane_codec_s.items()))
        lines.append(
            "  bytes as the tiers hold them (encoded); lanes' time encoding and decoding: "
            + (coding or "none")
        )
    if not r.tiers:
        lines.append("  (no tier: host memory below one chunk, kvoffload is off)")
    host = r.tier("host")
    if host is not None and len(r.tiers) > 1:
        share = host.evicted_without_copy / host.evictions if host.evictions else 0.0
        lines.append(
            f"  host evictions without a lower-tier copy: {host.evicted_without_copy} "
            f"({share:.1%} of {host.evictions})"
        )
    if warning:
        lines.append(f"\n{warning}")
    lines.append(f"\n(simulated in {r.wall_s:.1f} s)")
    return "\n".join(lines)


def _chunk_lines(r: SimResult) -> list[str]:
    """The assumptions about chunks (and, with several groups, the groups)."""
    s, c, g = r.settings, r.cost, r.groups
    if g is None:
        return [
            f"  chunks       {s['chunk_tokens']} tokens x {c.bytes_per_token} B/token = "
            f"{format_bytes(r.chunk_bytes)}"
        ]
    n = len(g.kinds)
    capacity = "any length" if g.request_capacity is None else f"{g.request_capacity} tokens"
    return [
        f"  kv groups    {s['kv_groups']}: {n} groups of 1/{n} of the layers share "
        f"{g.pool_blocks} blocks (1 null); one request holds up to {capacity}",
        f"  chunks       one per group: {s['chunk_tokens']} tokens x {c.bytes_per_token} "
        f"B/token / {n} groups = {format_bytes(r.chunk_bytes)}",
    ]


def _codec_lines(r: SimResult) -> list[str]:
    """The assumptions about codecs (none without one)."""
    if all(t.codec.name == NONE for t in r.tiers):
        return []
    parts = []
    for t in r.tiers:
        c = t.codec
        if c.name == NONE:
            parts.append(f"{t.tier} none")
            continue
        where = "GPU to the engine, CPU" if c.gpu else "CPU"
        parts.append(
            f"{t.tier} {c.name} ({format_bytes(c.chunk_bytes)} a chunk, {c.ratio:.3g}x; "
            f"{where} encode {1e-9 / c.encode_s_per_byte:.3g} GB/s, decode "
            f"{1e-9 / c.decode_s_per_byte:.3g} GB/s)"
        )
    return [f"  codecs       {', '.join(parts)}; CPU coding time on the copy lanes"]


def _group_results(r: SimResult) -> list[str]:
    """Results of a run with several KV cache groups (none with one)."""
    g = r.groups
    if g is None:
        return []
    stored_full, stored_window = g.by_kind(g.stored)
    loaded_full, loaded_window = g.by_kind(g.loaded)
    one_group = r.settings["engine_tokens"]
    return [
        f"  engine KV held            peak {g.peak_context_tokens} context tokens in "
        f"{g.peak_blocks} of {g.pool_blocks - 1} blocks (one group in this memory: "
        f"{one_group} tokens)",
        f"  chunks per group          stored full {stored_full}, window {stored_window}; "
        f"loaded full {loaded_full}, window {loaded_window}  (per group: stored "
        f"{','.join(map(str, g.stored))}; loaded {','.join(map(str, g.loaded))})",
        f"  host bytes per token      {r.stored_bytes_per_token:.0f} B per stored token "
        f"(model: {r.cost.bytes_per_token} B/token)",
    ]
