"""The integrity checks of stored shares, as ``kvoffload inspect`` makes them.

A *share* is one rank's part of a chunk: one used slot of a rank's slab file (disk)
or one value (Redis). :func:`check_stored` verifies a Redis value without knowing the
engine's payload size: the payload length is read from the header, and the value
must be exactly that long. :func:`check_slot` verifies a disk slot as
:meth:`kvoffload.tiers.disk.DiskStore.read_into` does, against the payload size in
the slab's superblock. The KV cache group a reader expects is not known here: a
header must name a group below its own group count. Pure functions; no I/O.
"""

from __future__ import annotations

from kvoffload.core.chunk_format import (
    HEADER_BYTES,
    MAGIC,
    IntegrityError,
    IntegrityReason,
    check_header,
    check_payload,
)
from kvoffload.core.keys import ChunkKey, shard_key
from kvoffload.tiers.disk import KEY_OFFSET, PAYLOAD_OFFSET, parse_header_block

SLOT_HEAD_BYTES = KEY_OFFSET + 24
"""What a slot's header block holds: the chunk header, the chunk key and the write
sequence number (what :meth:`~kvoffload.tiers.disk.DiskStore.clear` zeroes)."""


def header_fields(header: bytes | memoryview) -> tuple[int, int] | None:
    """``(format version, payload length)`` of a header that starts with the magic;
    None for anything else (too short, another magic)."""
    view = memoryview(header)
    if len(view) < HEADER_BYTES or bytes(view[:4]) != MAGIC:
        return None
    return int.from_bytes(view[4:6], "little"), int.from_bytes(view[8:16], "little")


def check_stored(
    stored: bytes | memoryview, namespace_digest: bytes, key: ChunkKey, rank: int
) -> IntegrityError | None:
    """None when ``stored`` (one whole Redis value: header and payload) is what
    kvoffload writes for ``rank``'s share of ``key`` in the namespace
    ``namespace_digest``; otherwise the :class:`IntegrityError` naming the first
    failed check.

    Checks, in the order of the engine's readers: size of the header, magic, format
    version, namespace digest, storage key (``shard_key(key, rank)``), a KV cache group
    below the header's own group count (the reader also wants the group it asked for;
    inspect cannot know it); then, with the payload length ``L`` the header gives,
    that ``stored`` is exactly header + ``L`` bytes; then the xxh3 checksum.
    """
    view = memoryview(stored)
    fields = header_fields(view)
    length = fields[1] if fields is not None else 0
    storage_key = shard_key(key, rank)
    try:
        expected = check_header(
            view[:HEADER_BYTES], namespace_digest, storage_key, length, group=None
        )
        end = HEADER_BYTES + length
        if len(view) > end:
            raise IntegrityError(IntegrityReason.SIZE, f"{len(view)} bytes, at most {end} expected")
        check_payload(view[HEADER_BYTES:end], length, expected)
    except IntegrityError as exc:
        return exc
    return None


def slot_key(head: bytes | memoryview) -> ChunkKey:
    """The chunk key a slot's header block names (after the chunk header); a block
    cut short reads as zero-padded, as the disk tier's reader sees it."""
    block = bytes(head[:SLOT_HEAD_BYTES])
    return parse_header_block(block.ljust(SLOT_HEAD_BYTES, b"\0"))[0]


def check_slot_header(
    head: bytes | memoryview, namespace_digest: bytes, rank: int, payload_bytes: int
) -> IntegrityError | None:
    """None when the header block ``head`` (at least the chunk header and the key
    after it) is a valid header for ``rank``'s share of the chunk it names, in a slab
    of ``payload_bytes`` payloads: the check start-up recovery makes before adopting a
    slot (:func:`kvoffload.tiers.disk_index.scan_slab`), which takes any KV cache group
    the header validly names."""
    storage_key = shard_key(slot_key(head), rank)
    header = memoryview(head)[:HEADER_BYTES]
    try:
        check_header(header, namespace_digest, storage_key, payload_bytes, group=None)
    except IntegrityError as exc:
        return exc
    return None


def check_slot(
    slot: bytes | memoryview, namespace_digest: bytes, rank: int, payload_bytes: int
) -> IntegrityError | None:
    """None when ``slot`` (a whole slot as read from a slab, possibly cut short by
    the end of the file) holds a chunk the disk tier's reader accepts; otherwise the
    :class:`IntegrityError` it would raise.

    The checks of :meth:`kvoffload.tiers.disk.DiskStore.read_into`, the expected
    chunk key being the one after the header: the chunk header (size, magic, version,
    namespace digest, storage key ``shard_key(key, rank)``, payload length
    ``payload_bytes`` from the slab's superblock, a KV cache group below the header's
    group count: the reader's own group is not known here), then the payload at
    ``PAYLOAD_OFFSET`` (all there: ``size``; checksum). The padding after the payload
    is not checked (neither does the reader).
    """
    view = memoryview(slot)
    storage_key = shard_key(slot_key(view), rank)
    try:
        header = view[:HEADER_BYTES]
        expected = check_header(header, namespace_digest, storage_key, payload_bytes, group=None)
        check_payload(
            view[PAYLOAD_OFFSET : PAYLOAD_OFFSET + payload_bytes], payload_bytes, expected
        )
    except IntegrityError as exc:
        return exc
    return None
