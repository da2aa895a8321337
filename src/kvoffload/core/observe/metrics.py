"""Metric definitions: every metric kvoffload exports, declared once.

:data:`METRICS` holds each metric's name, kind, help and label names; the
Prometheus exporters and the metrics reference in ``docs/usage.md`` are generated
from it. Counters and histograms are recorded under these names in
:class:`kvoffload.core.observe.recorder.MetricsRecorder` (which refuses any other); gauges
are computed when read (:mod:`kvoffload.core.observe.metrics_view`).
"""

from __future__ import annotations

from dataclasses import dataclass

PREFIX = "kvoffload_"

Labels = tuple[tuple[str, str], ...]  # sorted (name, value) pairs
Series = tuple[str, Labels]  # (metric name without the prefix, labels)

BYTES_BUCKETS = tuple(float(1 << p) for p in range(12, 33, 2))  # 4 KiB .. 4 GiB
SECONDS_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)


@dataclass(frozen=True)
class MetricDef:
    name: str  # without the prefix
    kind: str  # "counter" | "gauge" | "histogram"
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()

    @property
    def full_name(self) -> str:
        return PREFIX + self.name


METRICS: tuple[MetricDef, ...] = (
    MetricDef("lookups_total", "counter", "Prefix lookups answered, per tier.", ("tier",)),
    MetricDef(
        "hit_tokens_total",
        "counter",
        "Tokens found: host = tokens loaded into the engine instead of recomputed; "
        "a lower tier = tokens found in it below host memory (then read into the engine or "
        "promoted).",
        ("tier",),
    ),
    MetricDef(
        "deferrals_total",
        "counter",
        "Lookups answered retry-later, by reason: transfer_in_flight (the request's own "
        "jobs), promotion, pending (its next chunk is being stored: the convoy case), "
        "lookup (a lower tier was asked), no_room (the engine did not admit the request "
        "and ran nothing since: the requests behind it go first), load_holder (sliding-"
        "window groups, nothing running: another request's load is in flight).",
        ("reason",),
    ),
    MetricDef(
        "deferral_seconds",
        "histogram",
        "How long a deferred request waited before it was admitted, by the last reason.",
        ("reason",),
        SECONDS_BUCKETS,
    ),
    MetricDef(
        "deferral_timeouts_total",
        "counter",
        "Deferrals that hit max_deferral_steps / max_deferral_seconds (the request recomputed).",
    ),
    MetricDef(
        "transfer_bytes",
        "histogram",
        "Bytes one worker moved in one job, by direction (load: host to engine, or a "
        "tier load's tier to engine, store: engine to host, spill: host to tier, "
        "promote: tier to host) and tier.",
        ("direction", "tier"),
        BYTES_BUCKETS,
    ),
    MetricDef(
        "transfer_seconds",
        "histogram",
        "Seconds one worker took for one job, by direction and tier.",
        ("direction", "tier"),
        SECONDS_BUCKETS,
    ),
    MetricDef(
        "transferred_chunks_total",
        "counter",
        "Chunks moved successfully, by direction and tier.",
        ("direction", "tier"),
    ),
    MetricDef(
        "failed_chunks_total",
        "counter",
        "Chunks whose transfer failed (the engine recomputes or the tier misses), by "
        "direction and tier.",
        ("direction", "tier"),
    ),
    MetricDef("evictions_total", "counter", "Chunks evicted to make room, per tier.", ("tier",)),
    MetricDef(
        "evicted_without_copy_total",
        "counter",
        "Chunks evicted from host memory that no lower tier held (only with a lower tier; "
        "write-through keeps it near 0: a chunk waiting for its spill is not evicted).",
        ("tier",),
    ),
    MetricDef(
        "admission_refusals_total",
        "counter",
        "Chunks not stored because they were not reused enough yet (store_threshold).",
        ("tier",),
    ),
    MetricDef(
        "no_room_total",
        "counter",
        "Stores refused because every slot was pinned or in flight, per tier.",
        ("tier",),
    ),
    MetricDef(
        "integrity_errors_total",
        "counter",
        "Chunks read from a tier that failed verification (a miss; the copy is deleted), "
        "by reason.",
        ("tier", "reason"),
    ),
    MetricDef(
        "tier_io_timeouts_total",
        "counter",
        "Lower-tier jobs still running past tier_io_timeout_ms: reported failed (the "
        "engine recomputes, the chunks stay in the tier), by direction and tier.",
        ("direction", "tier"),
    ),
    MetricDef(
        "missing_chunks_total",
        "counter",
        "Chunks a tier was expected to hold but did not have when read (a miss).",
        ("tier",),
    ),
    MetricDef(
        "probes_total",
        "counter",
        "Round trips a remote tier's index made to learn which chunks its server holds "
        "(one pipelined EXISTS of every rank's share, during a lookup or in the "
        "background), per tier.",
        ("tier",),
    ),
    MetricDef(
        "probed_keys_total",
        "counter",
        "Chunks a remote tier's index asked its server about, per tier.",
        ("tier",),
    ),
    MetricDef(
        "lookup_deferrals_total",
        "counter",
        "Lookups a remote tier answered ask-again (its probe was queued or in flight; "
        "the request waits a step), per tier.",
        ("tier",),
    ),
    MetricDef(
        "hits_declined_total",
        "counter",
        "Parts of hits recomputed instead of loaded (load_policy cost), by the tier that "
        "held them and reason: transfer (loading them was slower than recomputing), queue "
        "(an idle lane would have loaded them: the work queued on it was why), unmeasured "
        "(the tier's first load, which measures it, had been in flight longer than "
        "recomputing them takes), unanswered (the tier could not tell yet and its lane "
        "stood at recompute: its answer was not waited for). Counted per lookup; a part "
        "loaded in part as its lane's probe is counted in cost_probes_total instead.",
        ("tier", "reason"),
    ),
    MetricDef(
        "declined_tokens_total",
        "counter",
        "Tokens of declined hits (recomputed instead of loaded), by the tier that held them.",
        ("tier",),
    ),
    MetricDef(
        "cost_probes_total",
        "counter",
        "Probes of a lane the cost model declined (load_policy cost): loads of the first "
        "chunk of a hit's part on it, planned to re-measure the lane; at most one in flight "
        "per lane, due once a backoff (1 s, doubling to 64 s while the lane stays slow) has "
        "passed and the hits declined on it since the last probe would take 20 times its "
        "cost to recompute. By tier.",
        ("tier",),
    ),
    MetricDef(
        "cost_lane_latency_seconds",
        "gauge",
        "The cost model's fixed latency of one load on a lane (host: host memory to the "
        "engine; a lower tier: its reads), learned from its jobs' timings; absent "
        "while unmeasured.",
        ("tier",),
    ),
    MetricDef(
        "cost_lane_seconds_per_chunk",
        "gauge",
        "The cost model's transfer time of one chunk on a lane (per worker).",
        ("tier",),
    ),
    MetricDef(
        "cost_lane_bytes_per_second",
        "gauge",
        "The cost model's bandwidth of a lane (per worker).",
        ("tier",),
    ),
    MetricDef(
        "cost_lane_queued_chunks",
        "gauge",
        "Chunks of the loads and promotions in flight reading on a lane.",
        ("tier",),
    ),
    MetricDef(
        "cost_lane_loads",
        "gauge",
        "A lane's standing verdict: 1 loads, 0 recomputes (hysteresis holds it).",
        ("tier",),
    ),
    MetricDef(
        "cost_prefill_tokens_per_second",
        "gauge",
        "The engine's prefill speed the cost model uses (measured from step timings; the "
        "prefill_tokens_per_s seed until then).",
    ),
    MetricDef(
        "tier_load_seconds_per_chunk",
        "gauge",
        "For routers: the cost model's learned time to load one chunk from a tier into the "
        "engine (its lane's latency plus one chunk's transfer; with lower_tier_loads "
        "promote, a lower tier's plus host memory's); absent while unmeasured.",
        ("tier",),
    ),
    MetricDef(
        "tier_hit_weight",
        "gauge",
        "For routers, in place of a fixed weight per tier: the fraction of prefill time a "
        "token hit in a tier saves against recomputing it, 1 - load seconds per token / "
        "prefill seconds per token, in [0, 1], from tier_load_seconds_per_chunk (a "
        "one-chunk hit: longer ones save more) and cost_prefill_tokens_per_second; absent "
        "while unmeasured.",
        ("tier",),
    ),
    MetricDef("preemptions_total", "counter", "Requests preempted while kvoffload tracked them."),
    MetricDef(
        "anomalies_total",
        "counter",
        "Surprising engine input kvoffload survived by taking the safe way (the chunk is "
        "not stored or loaded, the request recomputes, or the report is ignored), by kind: "
        "null_block, duplicate_block, external_tokens, untracked_request, reused_request_id, "
        "chunk_gone, namespace_mismatch, lora_changed (a LoRA adapter id loaded with other "
        "contents: served without offloading until a restart).",
        ("kind",),
    ),
    MetricDef(
        "request_param_errors_total",
        "counter",
        "Requests whose kv_transfer_params kvoffload refused (served without offloading), "
        "by the offending field, e.g. kvoffload.max_load_tokens.",
        ("field",),
    ),
    MetricDef(
        "internal_errors_total",
        "counter",
        "Internal errors caught at the engine boundary; after the first, offloading is off "
        "for the rest of the engine's life (requests are served without it).",
    ),
    MetricDef(
        "resets_total", "counter", "Connector resets (nothing stored before is served after)."
    ),
    MetricDef(
        "weights_checks_total",
        "counter",
        "Times the workers were asked to fingerprint the weights again (after a reset of "
        "the engine's prefix cache or of the connector).",
    ),
    MetricDef(
        "weights_changes_total",
        "counter",
        "Times the weights' fingerprints changed while the engine ran (weights updated in "
        "place): KV computed with the old weights is never served afterwards.",
    ),
    MetricDef(
        "fenced_jobs_total",
        "counter",
        "Loads and stores a worker refused because its weights were not the ones the plan's "
        "keys name (a load is recomputed, a store never made readable), per direction.",
        ("direction",),
    ),
    MetricDef(
        "paused_resets_total",
        "counter",
        "Connector resets vLLM made while its scheduler was paused (sleep mode, a pause "
        "with clear_cache): every tier kept, the weights checked.",
    ),
    MetricDef(
        "sleep_refused_jobs_total",
        "counter",
        "Loads and stores a worker refused while the engine's KV memory was released (vLLM "
        "sleep mode): a load is recomputed, a store never made readable; per direction.",
        ("direction",),
    ),
    MetricDef("flushes_total", "counter", "Store jobs the workers were told to finish early."),
    MetricDef("usage_bytes", "gauge", "Bytes of chunks held, per tier.", ("tier",)),
    MetricDef(
        "codec_ratio",
        "gauge",
        "How many times smaller a tier keeps chunks than the engine's KV (its codec, "
        "decision 0023): a lower tier's as measured over the chunks it stored, else its "
        "slots' (1 without a codec).",
        ("tier",),
    ),
    MetricDef(
        "capacity_bytes",
        "gauge",
        "Capacity per tier (host and the bounded lower tiers; a shared server's is its "
        "own, e.g. its maxmemory).",
        ("tier",),
    ),
    MetricDef(
        "pinned_chunks", "gauge", "Chunks pinned by transfers in flight, per tier.", ("tier",)
    ),
    MetricDef(
        "host_share_calls_total",
        "counter",
        "The node-shared host tier's link (host_share), per outcome: connects (to a node "
        "process), server_starts (node processes this engine started), and calls that "
        "answered as a miss: unavailable (no node process), timeouts "
        "(past host_share_timeout_ms), lost (connection dropped), errors.",
        ("outcome",),
    ),
    MetricDef("jobs_in_flight", "gauge", "Transfer jobs not yet reported by every worker.", ()),
    MetricDef(
        "quarantined_chunks",
        "gauge",
        "Host slots held for spills and promotions reported past their deadline whose tier "
        "I/O has not returned yet, per lower tier.",
        ("tier",),
    ),
)

BY_NAME = {m.name: m for m in METRICS}


def labels(**pairs: str) -> Labels:
    return tuple(sorted(pairs.items()))
