"""Typed chunk failures and the tier lookup's typed answer: the old texts kept, read
by kind, picklable across the workers' reports."""

from __future__ import annotations

import itertools
import pickle
from collections.abc import Sequence

import pytest

from kvoffload.core.chunk_state import ChunkState
from kvoffload.core.directory import Directory
from kvoffload.core.failures import (
    MISSING,
    ChunkFailure,
    FailureKind,
    error_failure,
    integrity_failure,
    io_failure,
)
from kvoffload.core.jobs import JobResult, WorkerReport
from kvoffload.core.keys import ChunkKey
from kvoffload.core.tiering.lower import DirectoryTier
from kvoffload.core.tiering.planning import ABSENT, UNKNOWN, Found, TierPlanner


def K(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"))


ids = itertools.count(1).__next__


@pytest.mark.parametrize(
    ("failure", "text", "gone"),
    [
        (io_failure("No space left on device"), "io:No space left on device", False),
        (integrity_failure("checksum"), "integrity:checksum", True),
        (MISSING, "missing", True),
        (error_failure("ConnectionError: refused"), "ConnectionError: refused", False),
    ],
)
def test_a_failure_prints_as_the_old_reason_text(
    failure: ChunkFailure, text: str, gone: bool
) -> None:
    assert str(failure) == text and f"{failure}" == text
    assert failure.copy_gone is gone
    assert pickle.loads(pickle.dumps(failure)) == failure


def test_results_with_failures_cross_processes() -> None:
    result = JobResult(3, True, 8, failed_chunks=((1, integrity_failure("magic")), (2, MISSING)))
    whole = JobResult(4, False, error=integrity_failure("key"))
    report = WorkerReport(1, (result, whole, JobResult(5, False, error="worker is shut down")))
    again = pickle.loads(pickle.dumps(report))
    assert again == report
    assert again.results[0].failed_chunks[1][1] is not MISSING  # equal, not the same object
    assert again.results[0].failed_chunks[1][1].kind is FailureKind.MISSING


def promotion_setup() -> tuple[Directory, DirectoryTier, TierPlanner]:
    host = Directory(8)
    disk = DirectoryTier(Directory(8, tier="disk"))
    planner = TierPlanner(host, [disk], chunk_tokens=16)
    prepared = disk.directory.prepare_store([K(1), K(2)], admit_all=True)
    disk.directory.complete_store(prepared.keys, success=True)
    return host, disk, planner


@pytest.mark.parametrize(
    ("error", "forgotten", "integrity", "missing"),
    [
        (integrity_failure("checksum"), True, {"checksum": 2}, 0),
        (MISSING, True, {}, 2),
        ("ConnectionError: refused", False, {}, 0),
        ("", False, {}, 0),
    ],
)
def test_a_whole_promotion_failure_applies_its_error_to_every_chunk(
    error: str | ChunkFailure, forgotten: bool, integrity: dict[str, int], missing: int
) -> None:
    host, disk, planner = promotion_setup()
    job = planner.plan_promotion("r", "disk", [K(1), K(2)], ids)
    assert job is not None
    planner.complete(job, JobResult(job.job_id, success=False, error=error))
    assert [host.state_of(k) for k in (K(1), K(2))] == [ChunkState.FREE] * 2
    assert (disk.present_run([K(1), K(2)]) == 0) is forgotten
    assert disk.metrics.breakdown("integrity_errors_total", "reason") == integrity
    assert disk.metrics.value("missing_chunks_total") == missing
    assert disk.metrics.value("failed_chunks_total", direction="promote") == 2


class _Undecided(DirectoryTier):
    def present_run(self, keys: Sequence[ChunkKey]) -> int | None:
        return None


def test_find_below_answers_found_unknown_or_absent() -> None:
    host = Directory(8)
    disk = DirectoryTier(Directory(8, tier="disk"))
    planner = TierPlanner(host, [disk], chunk_tokens=16)
    assert planner.find_below([K(1)]) is ABSENT
    prepared = disk.directory.prepare_store([K(1), K(2)], admit_all=True)
    disk.directory.complete_store(prepared.keys, success=True)
    assert planner.find_below([K(1), K(2), K(3)]) == Found(disk, 2)
    assert planner.find_below([K(1)], allowed=lambda name: name != "disk") is ABSENT
    assert planner.find_below([K(3)]) is ABSENT
    front = _Undecided(Directory(8, tier="redis"))
    assert TierPlanner(host, [front, disk], chunk_tokens=16).find_below([K(1)]) is UNKNOWN
    assert disk.metrics.value("hit_tokens_total") == 2 * 16  # two chunks
