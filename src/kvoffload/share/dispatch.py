"""One request frame to one reply frame: decodes, calls the :class:`ShareBook`,
encodes. Pure over the book (no sockets); the server loop owns the connections.

A :class:`ContractViolation` becomes a VIOLATION reply (the book changed nothing);
any other exception an ERROR reply: the node process keeps serving the others.
"""

from __future__ import annotations

import struct

import numpy as np

from kvoffload.core.errors import ContractViolation
from kvoffload.core.keys import KEY_BYTES, ChunkKey
from kvoffload.share.book import Session, ShareBook
from kvoffload.share.feed import CURSOR, unpack_announce
from kvoffload.share.protocol import (
    FLAG_ADMIT_ALL,
    FLAG_GROUPS,
    STATES,
    STATS,
    FrameError,
    Op,
    Status,
    encode_prepared,
    pack_keys,
    pack_u32,
    unpack_keys,
    unpack_u32,
)


def dispatch(book: ShareBook, session: Session, op: int, payload: bytes) -> tuple[Status, bytes]:
    """Serve one call of ``session``; the reply's status and payload."""
    try:
        return Status.OK, _serve(book, session, Op(op), payload)
    except ContractViolation as exc:
        return Status.VIOLATION, str(exc).encode()
    except (FrameError, ValueError, struct.error) as exc:
        return Status.ERROR, f"bad request: {exc}".encode()


def _serve(book: ShareBook, session: Session, op: Op, payload: bytes) -> bytes:
    d = book.directory
    if op is Op.PREFIX:
        return struct.pack("<I", d.readable_prefix(unpack_keys(payload)))
    if op is Op.LOOKUP:
        return book.lookup(unpack_keys(payload))
    if op is Op.TOUCH:
        d.touch(unpack_keys(payload))
        return b""
    if op is Op.RECORD:
        d.record_lookups(unpack_keys(payload))
        return b""
    if op is Op.PREPARE_LOAD:
        return pack_u32(book.prepare_load(session, unpack_keys(payload)))
    if op is Op.COMPLETE_LOAD:
        book.complete_load(session, unpack_keys(payload))
        return b""
    if op is Op.PREPARE_STORE:
        return _prepare_store(book, session, payload)
    if op is Op.COMPLETE_STORE:
        return pack_u32(book.complete_store(session, unpack_keys(payload[1:]), bool(payload[0])))
    if op is Op.DISCARD:
        return pack_u32(book.discard(unpack_keys(payload)))
    if op is Op.RESET:
        return pack_keys(book.reset(session))
    if op is Op.STATES:
        return np.array(book.states(unpack_keys(payload)), dtype=STATES).tobytes()
    if op is Op.GROUPS:
        return pack_u32(d.groups_of(unpack_u32(payload)))
    if op is Op.STATS:
        return STATS.pack(
            d.num_slots, d.free_slots, d.evictable_count, d.storing_count,
            d.pinned_count, len(d), len(book.sessions), book.fenced_stores,
        )  # fmt: skip
    if op is Op.CHECK:
        book.check()
        return b""
    if op is Op.SYNC:
        (n_storing,) = struct.unpack_from("<I", payload)
        keys = unpack_keys(payload[4:])
        book.sync(session, keys[:n_storing], keys[n_storing:])
        return b""
    if op is Op.PRESENT:
        return pack_keys(d.present_keys())
    if op is Op.ANNOUNCE:
        book.announce(session, unpack_announce(payload))
        return b""
    if op is Op.FEED:
        since, epoch, budget = CURSOR.unpack(payload)
        return book.feed.read(session.namespace, since, epoch, budget)
    if op is Op.SNAPSHOT:
        return book.feed.snapshot(session.namespace)
    if op is Op.RECORDS:
        return book.feed.records(session.namespace, unpack_keys(payload))
    raise ValueError(f"unknown op {op}")


def _prepare_store(book: ShareBook, session: Session, payload: bytes) -> bytes:
    flags, n = struct.unpack_from("<BI", payload)
    at = struct.calcsize("<BI")
    keys = unpack_keys(payload[at : at + KEY_BYTES * n])
    groups = unpack_u32(payload[at + KEY_BYTES * n :]) if flags & FLAG_GROUPS else None
    prepared = book.prepare_store(session, keys, bool(flags & FLAG_ADMIT_ALL), groups)
    first: dict[ChunkKey, int] = {}
    for i, key in enumerate(keys):
        first.setdefault(key, i)
    return encode_prepared(
        [first[k] for k in prepared.keys],
        prepared.slots,
        prepared.evicted,
        [first[k] for k in prepared.refused],
        prepared.no_room,
    )
