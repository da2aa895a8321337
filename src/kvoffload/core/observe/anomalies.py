"""Surprising engine input that kvoffload survives: counted, logged, never raised.

The engine has the last word (it may override kvoffload's answers, hand out blocks
kvoffload does not expect, report what it never planned), and nothing on its output
path may raise. Such input is an *anomaly*: the scheduler half takes the safe way
(skip the chunk, recompute, ignore the report), counts it by kind in the scheduler
half's metrics recorder (``anomalies_total{kind}``), and logs the first occurrence
of each kind at WARNING (later ones at DEBUG, so a hot loop cannot flood the log).
Refused request parameters are counted the same way
(``request_param_errors_total{field}``).

Owned by one scheduler half; not thread-safe (the owner serializes access).
"""

from __future__ import annotations

import enum
import logging

from kvoffload.core.observe.recorder import MetricsRecorder

logger = logging.getLogger("kvoffload")


class Anomaly(enum.Enum):
    """Kinds of surprising input (the ``kind`` label of the metric)."""

    NULL_BLOCK = "null_block"  # a chunk to store or load names the engine's null block
    DUPLICATE_BLOCK = "duplicate_block"  # a chunk to store or load names a block twice
    EXTERNAL_TOKENS = "external_tokens"  # the engine allocated another hit than offered
    UNTRACKED_REQUEST = "untracked_request"  # scheduled, allocated or ended, unknown here
    REUSED_REQUEST_ID = "reused_request_id"  # a new request under a draining one's id
    CHUNK_GONE = "chunk_gone"  # a hit's chunk left host memory and the tier since lookup
    NAMESPACE_MISMATCH = "namespace_mismatch"  # a worker derived another namespace
    LORA_CHANGED = "lora_changed"  # a LoRA adapter id was loaded with other contents


class AnomalyLog:
    def __init__(self, metrics: MetricsRecorder) -> None:
        self.metrics = metrics

    def note(self, kind: Anomaly, detail: str) -> None:
        """Count one ``kind`` anomaly; ``detail`` says what happened and what was done."""
        self.metrics.count("anomalies_total", kind=kind.value)
        count = self.metrics.value("anomalies_total", kind=kind.value)
        level = logging.WARNING if count == 1 else logging.DEBUG
        logger.log(level, "kvoffload: %s (%s; occurrence %d)", detail, kind.value, count)

    @property
    def counts(self) -> dict[Anomaly, int]:
        """The kinds seen so far and how often (read from the recorder)."""
        seen = self.metrics.breakdown("anomalies_total", "kind")
        return {Anomaly(kind): n for kind, n in seen.items()}


class ParamErrorLog:
    """Per-request parameters kvoffload refused (``request_controls.py``): counted by
    field, the first refusal of each field logged at WARNING, later ones at DEBUG."""

    def __init__(self, metrics: MetricsRecorder) -> None:
        self.metrics = metrics

    def note(self, request_id: str, field: str) -> None:
        field = field[:80]  # a field name comes from the client
        self.metrics.count("request_param_errors_total", field=field)
        count = self.metrics.value("request_param_errors_total", field=field)
        logger.log(
            logging.WARNING if count == 1 else logging.DEBUG,
            "kvoffload: request %r: invalid kv_transfer_params field %r; the request is "
            "served without offloading (occurrence %d of this field)",
            request_id,
            field,
            count,
        )
