"""The wire format between engines and the node process: compact, binary, batched.

One call is one request frame and one reply frame on a Unix stream socket, a whole
batch of keys per frame (one round trip per directory call)::

    request:  u32 payload length | u8 op     | payload
    reply:    u32 payload length | u8 status | payload

An op with :data:`ONE_WAY` set gets no reply (``touch``, ``record_lookups`` and
``announce``, which answer nothing and cannot fail): the caller only sends it, and the node process
serves it before anything sent after it on that connection. All integers
little-endian. Keys are :data:`~kvoffload.core.keys.KEY_BYTES` bytes
each, packed back to back (no length prefix: the frame length gives their number).
Slot and index arrays are u32. A connection carries one call at a time; a caller that
stops waiting for a reply (timeout) must close the connection, since a late reply
would be taken for the next call's.

Pure functions over bytes, and the socket helpers that read whole frames.
"""

from __future__ import annotations

import enum
import socket
import struct
from collections.abc import Sequence

import numpy as np

from kvoffload.core.keys import KEY_BYTES, ChunkKey

HEADER = struct.Struct("<IB")
MAX_FRAME = 64 << 20
HELLO = struct.Struct("<16sBH")  # session id, role, namespace length (namespace follows)
WELCOME = struct.Struct("<QIIQHB16s")  # generation, pid, slots, slot bytes, ranks, fresh, slab id
STATS = struct.Struct("<8I")


class Op(enum.IntEnum):
    HELLO = 1  # session(16) role(u8) ns_len(u16) ns -> WELCOME
    LOOKUP = 2  # keys -> u8 status per key (0 miss, 1 hit, 2 hit pending)
    PREFIX = 3  # keys -> u32 readable prefix
    TOUCH = 4  # keys -> ()
    RECORD = 5  # keys -> ()
    PREPARE_LOAD = 6  # keys -> u32 slots
    COMPLETE_LOAD = 7  # keys -> ()
    PREPARE_STORE = 8  # u8 flags, u32 n, keys, [u32 groups] -> see encode_prepared
    COMPLETE_STORE = 9  # u8 success, keys -> u32 indices of keys that became readable
    DISCARD = 10  # keys -> u32 indices of keys that were readable
    RESET = 11  # () -> keys that were readable (this session's namespace only)
    STATES = 12  # keys -> per key u8 state, u32 pins, i64 slot
    GROUPS = 13  # u32 slots -> u32 groups
    STATS = 14  # () -> STATS
    CHECK = 15  # () -> () or an error
    SYNC = 16  # u32 n, storing keys, pinned keys (one per pin) -> ()
    PRESENT = 17  # () -> keys
    ANNOUNCE = 18  # (key, u32 n, record) ... -> () (one-way; see .feed)
    FEED = 19  # u64 since, u64 epoch, u32 budget -> see feed.unpack_feed
    SNAPSHOT = 20  # () -> u64 cursor, u64 epoch, keys with a record
    RECORDS = 21  # keys -> per key u32 n, record


class Role(enum.IntEnum):
    DIRECTORY = 0  # a scheduler half: makes calls
    LEASE = 1  # a worker or a watcher: holds its session open, makes no calls


class Status(enum.IntEnum):
    OK = 0
    VIOLATION = 1  # a contract violation: nothing changed (the text follows)
    ERROR = 2  # the node process failed to serve the call (the text follows)


ONE_WAY = 0x80
FLAG_ADMIT_ALL = 1
FLAG_GROUPS = 2
STATES = np.dtype([("state", "u1"), ("pins", "<u4"), ("slot", "<i8")])


class FrameError(ConnectionError):
    """The peer closed the connection or sent a frame that is not one."""


def pack_keys(keys: Sequence[ChunkKey]) -> bytes:
    data = b"".join(keys)
    if len(data) != KEY_BYTES * len(keys):
        raise ValueError(f"every chunk key must be {KEY_BYTES} bytes")
    return data


def unpack_keys(data: bytes | memoryview) -> list[ChunkKey]:
    if len(data) % KEY_BYTES:
        raise FrameError(f"{len(data)} bytes is not a whole number of keys")
    keys: list[ChunkKey] = np.frombuffer(data, dtype=f"V{KEY_BYTES}").tolist()
    return keys


def pack_u32(values: Sequence[int]) -> bytes:
    return np.asarray(values, dtype="<u4").tobytes()


def unpack_u32(data: bytes | memoryview) -> list[int]:
    values: list[int] = np.frombuffer(data, dtype="<u4").tolist()
    return values


def frame(code: int, payload: bytes = b"") -> bytes:
    return HEADER.pack(len(payload), code) + payload


def read_exactly(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes from ``sock`` (its timeout applies to each read); FrameError at EOF."""
    buffer = bytearray(n)
    view = memoryview(buffer)
    got = 0
    while got < n:
        count = sock.recv_into(view[got:])
        if count == 0:
            raise FrameError("connection closed")
        got += count
    return bytes(buffer)


def read_frame(sock: socket.socket) -> tuple[int, bytes]:
    """The next frame's code and payload."""
    length, code = HEADER.unpack(read_exactly(sock, HEADER.size))
    if length > MAX_FRAME:
        raise FrameError(f"frame of {length} bytes")
    return code, read_exactly(sock, length) if length else b""


def encode_prepared(
    new: Sequence[int], slots: Sequence[int], evicted: Sequence[ChunkKey],
    refused: Sequence[int], no_room: bool,
) -> bytes:  # fmt: skip
    """PREPARE_STORE's reply: indices (into the request's keys) of the keys to copy,
    their slots, the keys evicted, indices of the refused keys, ``no_room``."""
    head = struct.pack("<BIII", no_room, len(new), len(evicted), len(refused))
    return head + pack_u32(new) + pack_u32(slots) + pack_keys(evicted) + pack_u32(refused)


def decode_prepared(
    data: bytes,
) -> tuple[list[int], list[int], list[ChunkKey], list[int], bool]:
    no_room, n_new, n_evicted, n_refused = struct.unpack_from("<BIII", data)
    at = struct.calcsize("<BIII")
    new = unpack_u32(data[at : at + 4 * n_new])
    at += 4 * n_new
    slots = unpack_u32(data[at : at + 4 * n_new])
    at += 4 * n_new
    evicted = unpack_keys(data[at : at + KEY_BYTES * n_evicted])
    at += KEY_BYTES * n_evicted
    refused = unpack_u32(data[at : at + 4 * n_refused])
    return new, slots, evicted, refused, bool(no_room)
