"""The tier planner over a host directory or a lower tier that may not answer, or may
lose a chunk to another engine (a node-shared tier): every such call books nothing,
loses no queued spill and leaves no pin or slot behind (no engine, no worker)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from kvoffload.core.directory import Directory
from kvoffload.core.errors import DirectoryUnavailable
from kvoffload.core.jobs import JobKind, JobResult
from kvoffload.core.keys import ChunkKey
from kvoffload.core.tiering.lower import DirectoryTier
from kvoffload.core.tiering.planning import TierPlanner


def K(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"))


class Silent(Directory):
    """A directory whose calls with no miss in their contract raise
    :class:`DirectoryUnavailable` while ``silent`` is set, as a node-shared one does
    when its node process does not answer (and whose ``try_prepare_load`` then
    answers None)."""

    silent = False

    def slots_of(self, keys: Sequence[ChunkKey]) -> tuple[int, ...]:
        if self.silent:
            raise DirectoryUnavailable("not answered")
        return super().slots_of(keys)

    def groups_of(self, slots: Sequence[int]) -> tuple[int, ...]:
        if self.silent:
            raise DirectoryUnavailable("not answered")
        return super().groups_of(slots)

    def try_prepare_load(self, keys: Sequence[ChunkKey]) -> tuple[int, ...] | None:
        return None if self.silent else super().try_prepare_load(keys)


ids = itertools.count(1).__next__


def stored(host: Directory, keys: list[ChunkKey]) -> None:
    prepared = host.prepare_store(keys, admit_all=True)
    host.complete_store(prepared.keys, success=True)


def planner(host: Directory, disk: Directory, grouped: bool = False) -> TierPlanner:
    return TierPlanner(host, [DirectoryTier(disk)], chunk_tokens=16, grouped=grouped)


def test_an_unanswered_host_keeps_the_spill_queue_for_the_next_plan() -> None:
    host, disk = Silent(8), Directory(8, tier="disk")
    tiers = planner(host, disk)
    stored(host, [K(1), K(2)])
    tiers.note_stored([K(1), K(2)])
    assert host.pinned_count == 2 and tiers.queued_pins() == 2
    host.silent = True
    assert tiers.plan_spills(ids) == []
    assert tiers.queued_pins() == 2 and host.pinned_count == 2  # nothing lost, nothing freed
    assert disk.storing_count == 0  # no room booked below
    host.silent = False
    (job,) = tiers.plan_spills(ids)
    assert job.keys == (K(1), K(2)) and job.slots == host.slots_of([K(1), K(2)])
    tiers.complete(job, JobResult(job.job_id, success=True))
    assert host.pinned_count == 0 and disk.readable_prefix([K(1), K(2)]) == 2


def test_unanswered_groups_book_nothing_below_and_keep_the_queue() -> None:
    host, disk = Silent(8), Directory(8, tier="disk")
    tiers = planner(host, disk, grouped=True)
    prepared = host.prepare_store([K(1), K(2)], admit_all=True, groups=[0, 1])
    host.complete_store(prepared.keys, success=True)
    tiers.note_stored([K(1), K(2)])
    host.silent = True
    assert tiers.plan_spills(ids) == [] and disk.storing_count == 0
    host.silent = False
    (job,) = tiers.plan_spills(ids)
    assert job.groups == (0, 1)


def test_a_chunk_the_host_will_not_pin_is_not_queued() -> None:
    host, disk = Silent(8), Directory(8, tier="disk")
    tiers = planner(host, disk)
    stored(host, [K(1)])
    host.silent = True  # e.g. another engine evicted it, or no answer
    tiers.note_stored([K(1)])
    assert tiers.queued_pins() == 0 and host.pinned_count == 0
    host.silent = False
    assert tiers.plan_spills(ids) == []


def test_a_key_not_readable_is_skipped_and_the_others_queued() -> None:
    host, disk = Directory(8), Directory(8, tier="disk")
    tiers = planner(host, disk)
    stored(host, [K(1)])
    host.prepare_store([K(2)], admit_all=True)  # K(2) still being stored
    tiers.note_stored([K(1), K(2)])
    assert tiers.queued_pins() == 1 and host.pins_of(K(1)) == 1 and host.pins_of(K(2)) == 0


def test_a_discarded_queued_chunk_leaves_the_queue_and_frees_its_slot() -> None:
    host, disk = Directory(8), Directory(8, tier="disk")
    tiers = planner(host, disk)
    stored(host, [K(1), K(2)])
    tiers.note_stored([K(1), K(2)])
    host.discard([K(1)])
    (job,) = tiers.plan_spills(ids)
    assert job.keys == (K(2),)
    tiers.complete(job, JobResult(job.job_id, success=True))
    assert host.pinned_count == 0 and host.slot_of(K(1)) is None


def test_a_promotion_the_lower_tier_cannot_book_is_undone_in_host_memory() -> None:
    host, disk = Directory(8), Silent(8, tier="disk")
    tiers = planner(host, disk)
    stored(disk, [K(1), K(2)])
    disk.silent = True  # present at the lookup, not bookable now
    assert tiers.plan_promotion("r", "disk", [K(1), K(2)], ids) is None
    assert host.storing_count == 0 and host.slot_of(K(1)) is None
    assert disk.pinned_count == 0
    assert tiers.book_tier_load("disk", [K(1)]) is None
    disk.silent = False
    job = tiers.plan_promotion("r", "disk", [K(1), K(2)], ids)
    assert job is not None and job.kind is JobKind.PROMOTE and disk.pinned_count == 2


def test_a_promotion_whose_groups_are_unanswered_is_undone() -> None:
    host, disk = Silent(8), Directory(8, tier="disk")
    tiers = planner(host, disk, grouped=True)
    stored(disk, [K(1)])
    host.silent = True
    assert tiers.plan_promotion("r", "disk", [K(1)], ids, groups=[1]) is None
    assert host.storing_count == 0 and disk.pinned_count == 0
