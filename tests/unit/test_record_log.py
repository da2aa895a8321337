"""A persistent tier's announcement records (``tiers/record_log.py``): the last record
of each present key survives a restart, a torn tail ends the read (counted), and the
file is compacted once it holds several times the live records."""

from __future__ import annotations

from pathlib import Path

from kvoffload.core.keys import ChunkKey
from kvoffload.core.private_files import FilePolicy
from kvoffload.tiers.record_log import RecordLog


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "little"))


def test_recover_keeps_each_present_keys_last_record_and_stops_at_a_torn_tail(
    tmp_path: Path,
) -> None:
    policy = FilePolicy("test", key="disk_path")
    log = RecordLog(tmp_path, policy, lambda: [key(1), key(2)])
    log.append([(key(1), b"old"), (key(2), b"two"), (key(3), b"gone")])
    log.append([(key(1), b"new")])
    log.close()
    with (tmp_path / "announce.log").open("ab") as f:
        f.write(key(4)[:9])  # a crash mid-append
    again = RecordLog(tmp_path, policy, lambda: [key(1), key(2)])
    assert again.recover() == [(key(2), b"two"), (key(1), b"new")]
    assert again.damaged == 1
    assert RecordLog(tmp_path, policy, lambda: [key(1), key(2)]).recover() == [
        (key(2), b"two"),
        (key(1), b"new"),
    ]  # rewritten whole: nothing damaged left


def test_compaction_is_due_once_the_file_outgrows_the_live_records(tmp_path: Path) -> None:
    live = [0]
    counted = []

    def count() -> int:
        counted.append(1)
        return live[0]

    log = RecordLog(tmp_path, FilePolicy("test", key="disk_path"), list)
    live[0] = 600
    for i in range(1023):
        log.append([(key(i), b"r")])
    assert not log.needs_compaction(count) and not counted  # below 1,024: not even counted
    log.append([(key(1023), b"r")])
    assert not log.needs_compaction(count) and len(counted) == 1  # 1,024 <= 4 x 600
    dues = []
    for i in range(1024, 3072):
        log.append([(key(i), b"r")])
        dues.append(log.needs_compaction(count))
    # Counted again after 1,024 more entries (2,048: not yet four times 600), then at
    # 3,072, when it is due.
    assert len(counted) == 3 and dues[-1] and not any(dues[:-1])
    log.rewrite([(key(i), b"r") for i in range(600)])
    assert not log.needs_compaction(count)
