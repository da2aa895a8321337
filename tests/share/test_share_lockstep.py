"""A Hypothesis state machine drives a private :class:`Directory` and a share's
client (its node process in a thread) with the same calls, valid or not: every
answer, every raised contract violation, every event and counter must agree, and the
share's index must answer ``readable_prefix`` exactly as the private directory."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from share_fixtures import ThreadShares

from kvoffload.core.chunk_state import ChunkState
from kvoffload.core.directory import Directory
from kvoffload.core.errors import ContractViolation
from kvoffload.core.keys import ChunkKey
from kvoffload.share.meta import ShareGeometry

KEYS = [ChunkKey(i.to_bytes(16, "big")) for i in range(4)]
key_lists = st.lists(st.sampled_from(KEYS), max_size=5)
batches = st.lists(st.sampled_from(KEYS), min_size=1, max_size=3)


def outcome(call: Callable[[], Any]) -> Any:
    try:
        return ("ok", call())
    except ContractViolation:
        return ("violation", None)


class Lockstep(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="kvs-", dir="/tmp"))
        self.shares = ThreadShares(self.root)
        paths = self.shares.serve("lockstep", ShareGeometry(num_slots=2, slot_bytes=64))
        self.share = self.shares.client(paths, lease=False)
        self.private = Directory(2)

    def both(self, call: Callable[[Any], Any]) -> Any:
        expected = outcome(lambda: call(self.private))
        assert outcome(lambda: call(self.share)) == expected
        return expected

    @rule(keys=batches, admit_all=st.booleans())
    def prepare_store(self, keys: list[ChunkKey], admit_all: bool) -> None:
        self.both(lambda d: d.prepare_store(keys, admit_all=admit_all))

    @rule(keys=batches, success=st.booleans())
    def complete_store(self, keys: list[ChunkKey], success: bool) -> None:
        self.both(lambda d: d.complete_store(keys, success))

    @rule(keys=batches)
    def prepare_load(self, keys: list[ChunkKey]) -> None:
        self.both(lambda d: d.prepare_load(keys))

    @rule(keys=batches)
    def complete_load(self, keys: list[ChunkKey]) -> None:
        self.both(lambda d: d.complete_load(keys))

    def _with(self, state: ChunkState) -> list[ChunkKey]:
        return [k for k in KEYS if self.private.state_of(k) is state]

    @rule(data=st.data(), success=st.booleans())
    def complete_a_store(self, data: st.DataObject, success: bool) -> None:
        storing = self._with(ChunkState.STORING)
        if storing:
            keys = data.draw(st.lists(st.sampled_from(storing), min_size=1, unique=True))
            self.both(lambda d: d.complete_store(keys, success))

    @rule(data=st.data())
    def load(self, data: st.DataObject) -> None:
        readable = self._with(ChunkState.READY) + self._with(ChunkState.PINNED)
        if readable:
            keys = data.draw(st.lists(st.sampled_from(readable), min_size=1, max_size=3))
            self.both(lambda d: d.prepare_load(keys))

    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        pinned = self._with(ChunkState.PINNED)
        if pinned:
            key = data.draw(st.sampled_from(pinned))
            self.both(lambda d: d.complete_load([key]))

    @rule(keys=key_lists)
    def discard(self, keys: list[ChunkKey]) -> None:
        self.both(lambda d: d.discard(keys))

    @rule(keys=key_lists)
    def touch(self, keys: list[ChunkKey]) -> None:
        self.both(lambda d: d.touch(keys))

    @rule()
    def reset(self) -> None:
        self.both(lambda d: sorted(d.reset()))

    @rule(data=st.data())
    def queries(self, data: st.DataObject) -> None:
        readable = self._with(ChunkState.READY) + self._with(ChunkState.PINNED)
        keys = data.draw(st.lists(st.sampled_from(readable), max_size=3)) if readable else []
        keys += data.draw(key_lists)
        self.both(lambda d: d.lookup(keys))
        self.both(lambda d: d.readable_prefix(keys))
        self.both(lambda d: [(d.state_of(k), d.pins_of(k), d.slot_of(k) is None) for k in keys])

    @invariant()
    def agree(self) -> None:
        self.both(lambda d: (d.free_slots, d.evictable_count, d.pinned_count, len(d)))
        self.both(lambda d: d.take_events())
        self.both(lambda d: [d.metrics.value(n) for n in ("evictions_total", "no_room_total")])
        self.share.check_integrity()

    def teardown(self) -> None:
        self.shares.close()
        shutil.rmtree(self.root, ignore_errors=True)


Lockstep.TestCase.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
test_share_agrees_with_a_private_directory = Lockstep.TestCase
