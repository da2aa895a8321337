"""Inputs, settings and counters of the scheduler half (all engine-agnostic).

The engine (the vLLM adapter, or the reference engine) describes each step with a
:class:`StepInput`; requests are read through the :class:`EngineRequest` protocol,
which vLLM's ``Request`` satisfies as is.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvoffload.core.config.options import default
from kvoffload.core.errors import ConfigError
from kvoffload.core.kv_groups import ONE_GROUP, KVGroups
from kvoffload.core.observe.metrics import Series, labels


class EngineRequest(Protocol):
    """What the scheduler half reads from an engine's request object."""

    @property
    def request_id(self) -> str: ...

    @property
    def block_hashes(self) -> Sequence[bytes]:
        """Chained, salted hashes of the request's full blocks (grows with tokens)."""
        ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_computed_tokens(self) -> int: ...

    # Optional (read with getattr, default False): ``skip_reading_prefix_cache``, true
    # for a request that must not be served cached KV (vLLM sets it for requests with
    # prompt logprobs). Lookup answers 0 for it at once.


class Deferral(enum.Enum):
    """Why lookup answered *retry later*."""

    TRANSFER_IN_FLIGHT = "transfer_in_flight"  # the request's own jobs are in flight
    PROMOTION = "promotion"  # its next chunks are being brought up from a lower tier
    PENDING = "pending"  # its next chunk is being stored to host memory
    LOOKUP = "lookup"  # a lower tier is being asked whether it holds the next chunks
    NO_ROOM = "no_room"  # the engine did not admit the request and ran nothing since
    WEIGHTS = "weights"  # the workers' weights are being fingerprinted (start, after a reset)
    LOAD_HOLDER = "load_holder"  # window groups: another request's load holds engine blocks


RETRY_LATER = None
"""Lookup's answer when the request must be asked again in a later step."""


@dataclass(frozen=True)
class ScheduledRequest:
    """One request scheduled in this step.

    ``block_ids``: per KV cache group, the blocks added to the request this step;
    when ``replace`` is true (first schedule, or resumed after preemption) it is the
    request's whole allocation, whose first ``num_computed_tokens // block_size``
    blocks already hold KV (prefix hits or loaded). Blocks past those are *fresh*:
    this step's forward pass (or a load) writes them.
    """

    request_id: str
    num_computed_tokens: int
    num_scheduled_tokens: int
    block_ids: tuple[tuple[int, ...], ...] = ()
    replace: bool = False


@dataclass(frozen=True)
class StepInput:
    """What the engine scheduled in one step, given to ``build_plan``."""

    scheduled: tuple[ScheduledRequest, ...] = ()
    preempted: tuple[str, ...] = ()


@dataclass(frozen=True)
class SchedulerConfig:
    """Geometry and bounds of the scheduler half.

    ``null_block``: the id of the engine's placeholder block, which never holds a
    request's KV (vLLM's block 0), or None. A chunk naming it is never stored or loaded.

    ``kv_groups``: the engine's KV cache groups (:mod:`kvoffload.core.kv_groups`);
    every request then has one block table per group.

    ``direct_tier_loads``: a hit in a lower tier is offered at once and loaded from
    there straight into the engine's blocks (a tier load, through the worker's bounded
    staging area); off, it is first promoted into host memory (which needs room for
    the whole run) while the request waits.

    ``load_policy``: ``cost`` offers a hit only where loading beats recomputing it
    (:mod:`kvoffload.core.cost`, decision 0013), ``always`` offers every hit. The
    engine-facing default is the user option's (``cost``); this internal default is
    ``always`` so that engines built directly on the scheduler half (the reference
    engine, the explorer) keep deterministic offers unless they opt in.
    ``prefill_tokens_per_s``: the engine's prefill speed assumed until step timings
    measure it.

    ``one_load_beside_windows``: on an engine with a sliding-window group, while
    another request's load is in flight and none runs, lookup answers retry later
    (deferral ``load_holder``): vLLM's scheduler (0.32, 0.33) can otherwise strand two
    requests whose loads landed (fuzzer seed 276, decision 0008). Set by the vLLM
    adapter; engines without that queue of block holders (the reference engine, the
    simulator) leave it off.

    ``testing_disable_inflight_deferral`` exists only so the interleaving explorer
    can show that it finds the race this deferral prevents; never set it otherwise.
    """

    block_size: int
    blocks_per_chunk: int = 1
    world_size: int = 1
    hash_block_size: int = 0  # tokens per engine block hash; 0: the block size
    max_deferral_steps: int = default("max_deferral_steps")
    max_deferral_seconds: float = default("max_deferral_seconds")
    null_block: int | None = None
    kv_groups: KVGroups = ONE_GROUP
    direct_tier_loads: bool = default("lower_tier_loads") == "direct"
    load_policy: str = "always"
    prefill_tokens_per_s: float = default("prefill_tokens_per_s")
    one_load_beside_windows: bool = False
    testing_disable_inflight_deferral: bool = False

    def __post_init__(self) -> None:
        for name in ("block_size", "blocks_per_chunk", "world_size", "max_deferral_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(name, f"invalid value {value!r}; accepted: integer >= 1")
        if not self.max_deferral_seconds > 0:
            raise ConfigError(
                "max_deferral_seconds",
                f"invalid value {self.max_deferral_seconds!r}; accepted: number > 0",
            )
        if self.load_policy not in ("cost", "always"):
            raise ConfigError(
                "load_policy", f"invalid value {self.load_policy!r}; accepted: cost | always"
            )
        if not self.prefill_tokens_per_s > 0:
            raise ConfigError(
                "prefill_tokens_per_s",
                f"invalid value {self.prefill_tokens_per_s!r}; accepted: number > 0",
            )

        if self.hash_block_size < 0 or (
            self.hash_block_size and self.chunk_tokens % self.hash_block_size
        ):
            raise ConfigError(
                "hash_block_size",
                f"invalid value {self.hash_block_size!r}; accepted: a divisor of the chunk "
                f"size {self.chunk_tokens}",
            )

    @property
    def chunk_tokens(self) -> int:
        return self.block_size * self.blocks_per_chunk

    @property
    def hash_tokens(self) -> int:
        """Tokens covered by one engine block hash."""
        return self.hash_block_size or self.block_size

    @property
    def hashes_per_chunk(self) -> int:
        return self.chunk_tokens // self.hash_tokens


@dataclass
class SchedulerStats:
    """Job counts that are no metric (tests and harness outcomes read them), mutated
    only by the owning scheduler half. Every exported counter is recorded in its
    metrics recorder instead (``OffloadScheduler.metrics``)."""

    loads: int = 0  # load jobs planned (with at least one chunk)
    load_failures: int = 0  # load jobs that failed
    stores: int = 0  # store jobs planned
    store_failures: int = 0  # store jobs that failed
    stale_completions: int = 0  # worker results for jobs no longer tracked


SCHEDULER_SERIES: tuple[Series, ...] = (
    ("lookups_total", labels(tier="host")),
    ("hit_tokens_total", labels(tier="host")),
    ("deferral_timeouts_total", ()),
    ("transferred_chunks_total", labels(direction="load", tier="host")),
    ("transferred_chunks_total", labels(direction="store", tier="host")),
    ("failed_chunks_total", labels(direction="load", tier="host")),
    ("failed_chunks_total", labels(direction="store", tier="host")),
    ("preemptions_total", ()),
    ("hits_declined_total", labels(tier="host", reason="transfer")),
    ("internal_errors_total", ()),
    ("resets_total", ()),
    ("weights_checks_total", ()),
    ("weights_changes_total", ()),
    ("flushes_total", ()),
)
"""The scheduler half's fixed counter series, exported (at 0) from the start."""
