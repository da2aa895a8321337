"""The fleet's check of what its engines announce to routers (decision 0022), with
vLLM's KV events on (``HarnessSpec.kv_events``).

After each fleet step, every live engine's share announcer runs two rounds (the
harness drives them: its thread is stopped), the first sending the records the step
produced, the second reading what the others sent. Then, for each node-shared tier,
an observer (a feed reader of its own session) reads the share's recorded set, and:

- every recorded chunk is readable in the share (a lookup, which changes nothing);
- every engine synchronized with the same node process (its reader on the same feed
  epoch; one whose connection is down catches up later) announced exactly that set;
- what the engine published (the events its vLLM publisher got: ``BlockStored`` and
  ``BlockRemoved`` of the tier's medium, replayed in order) leaves exactly the
  announced chunks' block hashes credited.

Returns how many engine-tier pairs were checked with a share that held recorded
chunks (the coverage the fuzzer reports); raises :class:`HarnessViolation`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvoffload.adapters.vllm.compat import BlockRemoved, BlockStored, maybe_convert_block_hash
from kvoffload.adapters.vllm.events import LOCALITY, MEDIUM
from kvoffload.core.directory import LookupStatus
from kvoffload.share.client import ShareDirectory
from kvoffload.share.feed_reader import FeedReader
from kvoffload.share.paths import SharePaths
from kvoffload.testing.vllm_harness.checks import HarnessViolation

if TYPE_CHECKING:
    from kvoffload.testing.vllm_harness.harness import VllmHarness

Credit = tuple[tuple[Any, ...], int]  # a chunk's converted block hashes and its group


def check_announcements(live: Sequence[VllmHarness]) -> int:
    """Check the ``live`` engines of a fleet (see the module docstring)."""
    engines = [h for h in live if h.side.events is not None]
    announcers = [h.side.events.announcer for h in engines if h.side.events is not None]
    if not engines or any(a is None for a in announcers):
        return 0
    for _ in range(2):
        for announcer in announcers:
            assert announcer is not None
            announcer.round()
    checked = 0
    for tier, opened in engines[0].side.tiers.shares.items():
        observer = FeedReader(opened.share.paths, os.urandom(16),
                              opened.directory.link.namespace, timeout_s=10.0)  # fmt: skip
        try:
            snapshot = observer.poll()
            if not snapshot.full:
                continue  # no node process answers now
            recorded = {key for key, _ in snapshot.stored}
            _check_readable(opened.share.paths, tier, recorded)
            for h in engines:
                done = _check_engine(h, tier, recorded, observer.epoch)
                checked += done if recorded else 0  # (an empty share's check is counted apart)
        finally:
            observer.close()
    return checked


def _check_readable(paths: SharePaths, tier: str, recorded: set[Any]) -> None:
    """Every chunk the feed keeps a record of is readable in the share (a lookup:
    it changes nothing)."""
    if not recorded:
        return
    observer = ShareDirectory(paths, start_server=False, lease=False, users=False,
                              fence=False, timeout_s=10.0)  # fmt: skip
    try:
        statuses = observer.lookup(sorted(recorded)).statuses
    finally:
        observer.close()
    missing = sum(s is not LookupStatus.HIT for s in statuses)
    if missing:
        raise HarnessViolation(
            f"{tier} share: the feed keeps records of {missing} chunks it does not hold"
        )


def _check_engine(h: VllmHarness, tier: str, recorded: set[Any], epoch: int) -> int:
    events = h.side.events
    announcer = events.announcer if events is not None else None
    if announcer is None or announcer.readers[tier].epoch != epoch:
        return 0  # not synchronized with this node process (yet)
    announced = announcer.announced[tier]
    if set(announced) != recorded:
        raise HarnessViolation(
            f"{tier} share: an engine announced {len(announced)} chunks, the share holds "
            f"{len(recorded)} recorded ({len(set(announced) - recorded)} announced but not "
            f"held, {len(recorded - set(announced))} held but not announced)"
        )
    convert: Any = maybe_convert_block_hash
    want = {(tuple(convert(x) for x in held[0]), held[1]) for held in announced.values()}
    got = _credited(h.published, tier)
    if got != want:
        raise HarnessViolation(
            f"{tier} share: an engine's published events credit {len(got)} chunks, it "
            f"announced {len(want)} ({len(got - want)} credited but not announced)"
        )
    return 1


def _credited(published: list[object], tier: str) -> set[Credit]:
    """The chunks ``published`` leaves credited in ``tier``, replayed in order."""
    medium, locality = MEDIUM[tier], LOCALITY[tier]
    credited: set[Credit] = set()
    for event in published:
        if getattr(event, "medium", None) != medium:
            continue
        if getattr(event, "locality", None) != locality:
            continue
        group = getattr(event, "group_idx", None) or 0
        if isinstance(event, BlockStored):
            credited.add((tuple(event.block_hashes), group))
        elif isinstance(event, BlockRemoved):
            credited.discard((tuple(event.block_hashes), group))
    return credited
