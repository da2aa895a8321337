"""A Hypothesis state machine drives each host directory implementation
(``tests/contract/directory_envs.py``: ``engine``, ``share``, ``sim``) against a
simple model.

The model tracks, per key: absent, STORING, READY with n pins, or *discarded while
in flight* (its slot stays used until its job completes). After every step:
capacity is never exceeded, pins are never negative, pinned or pending chunks were
never evicted, every completed store stays readable until evicted or discarded, and
``check_integrity()`` holds. The share runs fewer examples (each is a node process
served from a thread, every call a round trip).
"""

from __future__ import annotations

import importlib.util
import sys
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvoffload.core.directory import HostDirectory, LookupStatus
from kvoffload.core.keys import ChunkKey
from kvoffload.core.policies import policy_names

KEYS = [ChunkKey(i.to_bytes(16, "big")) for i in range(10)]
CAPACITY = 4
key_lists = st.lists(st.sampled_from(KEYS), max_size=6)
store_batches = st.lists(st.sampled_from(KEYS), min_size=1, max_size=3)
EXAMPLES = {"engine": 300, "share": 100, "sim": 300}  # a share: ~25 ms an example


def _directory_envs() -> ModuleType:
    """``tests/contract/directory_envs.py``, one module whichever suite imports it first."""
    name = "directory_envs"
    if name not in sys.modules:
        path = Path(__file__).parents[1] / "contract" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@dataclass
class Entry:
    state: str  # "storing" | "ready"
    pins: int = 0
    discarded: bool = False  # out of the index, slot held until its job completes


@dataclass
class Model:
    entries: dict[ChunkKey, Entry] = field(default_factory=dict)
    counts: dict[ChunkKey, int] = field(default_factory=dict)

    def live(self, key: ChunkKey) -> Entry | None:
        entry = self.entries.get(key)
        return entry if entry is not None and not entry.discarded else None

    def status(self, key: ChunkKey) -> LookupStatus:
        entry = self.live(key)
        if entry is None:
            return LookupStatus.MISS
        return LookupStatus.HIT_PENDING if entry.state == "storing" else LookupStatus.HIT


class DirectoryMachine(RuleBasedStateMachine):
    """Over directories of ``implementation`` (an id of ``directory_envs``); what the
    one it opens holds is released at teardown."""

    def __init__(self, implementation: str) -> None:
        super().__init__()
        self.model = Model()
        self.stores: list[tuple[ChunkKey, ...]] = []
        self.loads: list[tuple[ChunkKey, ...]] = []
        self.stack = ExitStack()
        self.make = self.stack.enter_context(_directory_envs().directories(implementation))
        self.directory: HostDirectory

    def teardown(self) -> None:
        self.stack.close()

    @initialize(policy=st.sampled_from(policy_names()), threshold=st.sampled_from([1, 1, 2]))
    def setup(self, policy: str, threshold: int) -> None:
        self.threshold = threshold
        self.directory = self.make(
            CAPACITY, tier="t", policy=policy, store_threshold=threshold, max_admission_counters=64
        )

    # ------------------------------------------------------------------ rules

    @rule(keys=key_lists)
    def lookup(self, keys: list[ChunkKey]) -> None:
        result = self.directory.lookup(keys)
        expected = tuple(self.model.status(k) for k in keys)
        assert result.statuses == expected
        prefix = next((i for i, s in enumerate(expected) if s is not LookupStatus.HIT), len(keys))
        assert result.readable_prefix == prefix == self.directory.readable_prefix(keys)

    @rule(keys=key_lists)
    def record_and_touch(self, keys: list[ChunkKey]) -> None:
        self.directory.record_lookups(keys)
        self.directory.touch(keys)
        if self.threshold > 1:
            for key in keys:
                if self.model.live(key) is None:
                    self.model.counts[key] = self.model.counts.get(key, 0) + 1

    @rule(keys=store_batches)
    def prepare_store(self, keys: list[ChunkKey]) -> None:
        before = {k: self.model.status(k) for k in KEYS}
        batch = list(dict.fromkeys(keys))
        candidates = [k for k in batch if k not in self.model.entries]
        new = [k for k in candidates if self.model.counts.get(k, 0) >= self.threshold]
        if self.threshold == 1:
            new = candidates
        evictable = {
            k
            for k, e in self.model.entries.items()
            if not e.discarded and e.state == "ready" and e.pins == 0 and k not in batch
        }
        free = CAPACITY - len(self.model.entries)
        prep = self.directory.prepare_store(keys)
        assert set(prep.refused) == set(candidates) - set(new)
        if new and len(new) - free > len(evictable):
            assert prep.no_room and prep.keys == () and prep.evicted == ()
            assert {k: self.model.status(k) for k in KEYS} == before
            return
        assert not prep.no_room
        assert list(prep.keys) == new
        assert len(prep.evicted) == max(0, len(new) - free)
        assert set(prep.evicted) <= evictable  # never pinned, pending or in the batch
        for key in prep.evicted:
            del self.model.entries[key]
        for key in new:
            self.model.entries[key] = Entry("storing")
            self.model.counts.pop(key, None)
        if new:
            self.stores.append(prep.keys)

    @rule(keys=store_batches)
    def store_and_complete(self, keys: list[ChunkKey]) -> None:
        """The common path: a store that completes at once (fills the tier quickly)."""
        pending = len(self.stores)
        self.prepare_store(keys)
        if len(self.stores) > pending:
            self._complete(self.stores.pop(), success=True)

    @precondition(lambda self: self.stores)
    @rule(data=st.data(), success=st.booleans())
    def complete_store(self, data: st.DataObject, success: bool) -> None:
        self._complete(self.stores.pop(data.draw(st.integers(0, len(self.stores) - 1))), success)

    def _complete(self, batch: tuple[ChunkKey, ...], success: bool) -> None:
        self.directory.complete_store(batch, success)
        for key in batch:
            entry = self.model.entries[key]
            assert entry.state == "storing"
            if success and not entry.discarded:
                entry.state = "ready"
            else:
                del self.model.entries[key]

    @rule(data=st.data())
    def prepare_load(self, data: st.DataObject) -> None:
        readable = [k for k in KEYS if self.model.status(k) is LookupStatus.HIT]
        if not readable:
            return
        keys = data.draw(st.lists(st.sampled_from(readable), min_size=1, max_size=3))
        slots = self.directory.prepare_load(keys)
        assert slots == tuple(self.directory.slot_of(k) for k in keys)
        for key in keys:
            self.model.entries[key].pins += 1
        self.loads.append(tuple(keys))

    @precondition(lambda self: self.loads)
    @rule(data=st.data())
    def complete_load(self, data: st.DataObject) -> None:
        batch = self.loads.pop(data.draw(st.integers(0, len(self.loads) - 1)))
        self.directory.complete_load(batch)
        for key in batch:
            entry = self.model.entries[key]
            entry.pins -= 1
            if entry.pins == 0 and entry.discarded:
                del self.model.entries[key]

    @rule(keys=key_lists)
    def discard(self, keys: list[ChunkKey]) -> None:
        removed = self.directory.discard(keys)
        expected = []
        for key in dict.fromkeys(keys):
            entry = self.model.live(key)
            if entry is None:
                continue
            if entry.state == "ready":
                expected.append(key)
            if entry.state == "ready" and entry.pins == 0:
                del self.model.entries[key]
            else:
                entry.discarded = True
        assert removed == expected

    @rule()
    def reset(self) -> None:
        self.directory.reset()
        self.model.counts.clear()
        for key in list(self.model.entries):
            entry = self.model.entries[key]
            if entry.state == "ready" and entry.pins == 0:
                del self.model.entries[key]
            else:
                entry.discarded = True

    @rule()
    def drain_events(self) -> None:
        for event in self.directory.take_events():
            assert event.tier == "t" and event.keys

    # ------------------------------------------------------------- invariants

    @invariant()
    def matches_the_model(self) -> None:
        d = self.directory
        d.check_integrity()
        assert d.used_slots == len(self.model.entries) <= CAPACITY
        for key in KEYS:
            entry = self.model.live(key)
            assert d.pins_of(key) == (entry.pins if entry else 0) >= 0
        assert d.pinned_count == sum(e.pins for e in self.model.entries.values())
        assert d.lookup(KEYS).statuses == tuple(self.model.status(k) for k in KEYS)


@pytest.mark.parametrize("implementation", list(EXAMPLES))
def test_directory_machine(implementation: str) -> None:
    run_state_machine_as_test(
        lambda: DirectoryMachine(implementation),
        settings=settings(
            max_examples=EXAMPLES[implementation], stateful_step_count=40, deadline=None
        ),
    )
