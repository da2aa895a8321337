"""Pipelined GETs and SETs of chunk values straight from and into host slots.

redis-py (with hiredis) turns every reply into a new ``bytes`` object, which the
store then copies into the host slot: two passes over megabytes per chunk. Here a
pipeline of ``GET`` commands is sent on one pooled connection and the replies are
parsed by hand (RESP2 or RESP3, whichever the connection speaks): each value's
64-byte header is read into a small buffer and its payload with ``recv_into``
directly into the caller's view (the host slot being promoted into). Single-node
clients only (``redis.Redis`` with its connection pool; plain or TLS sockets); the
cluster client keeps redis-py's path.

Contract of :func:`get_into`: per name, ``"ok"`` (header in ``headers[i]``, payload
in ``outs[i]``, both still to be verified), ``"short:N"`` (the same, a payload of
``N`` bytes in ``outs[i][:N]``: a value shorter than the buffer, as a variable-size
codec stores), ``"missing"``, ``"size"`` (a value longer than header and buffer, or
shorter than a header: consumed and dropped, ``outs[i]`` untouched), ``"type"`` (not a
string value). Any other error reply (e.g. a server still loading its data) raises
``redis.ResponseError`` once every reply is consumed, as redis-py's pipelines do.
``outs[i]`` may hold unverified bytes whatever the answer: the caller owns a slot
that is not readable until verified. Socket errors and timeouts raise
``redis.ConnectionError`` / ``redis.TimeoutError`` after dropping the connection
(its stream position is lost).
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

_LINE_READ = 4096  # a reply line is read with at most this much look-ahead


class _Replies:
    """RESP reader over one socket; look-ahead bytes kept in ``_buf[_pos:]``."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buf = bytearray()
        self._pos = 0

    def _fill(self) -> None:
        chunk = self._sock.recv(_LINE_READ)
        if not chunk:
            raise ConnectionError("connection closed by the server")
        if self._pos:
            del self._buf[: self._pos]
            self._pos = 0
        self._buf += chunk

    def line(self) -> bytes:
        """One reply line without its CRLF."""
        while True:
            end = self._buf.find(b"\r\n", self._pos)
            if end >= 0:
                out = bytes(self._buf[self._pos : end])
                self._pos = end + 2
                return out
            self._fill()

    def read_into(self, view: memoryview) -> None:
        """Fill ``view`` exactly: look-ahead bytes first, then ``recv_into``."""
        got = min(len(self._buf) - self._pos, len(view))
        view[:got] = self._buf[self._pos : self._pos + got]
        self._pos += got
        while got < len(view):
            n = self._sock.recv_into(view[got:])
            if n == 0:
                raise ConnectionError("connection closed by the server")
            got += n

    def skip(self, nbytes: int) -> None:
        scratch = memoryview(bytearray(min(nbytes, 1 << 20) or 1))
        while nbytes > 0:
            step = min(nbytes, len(scratch))
            self.read_into(scratch[:step])
            nbytes -= step


@contextmanager
def _pooled(client: Any, what: str) -> Iterator[tuple[socket.socket, _Replies]]:
    """A connection from ``client``'s pool, as its socket and a reply reader; released
    on exit. Any failure inside drops the connection (its stream position is lost);
    socket errors become ``redis.ConnectionError`` / ``redis.TimeoutError``."""
    import redis

    pool = client.connection_pool
    conn = pool.get_connection()
    try:
        yield conn._sock, _Replies(conn._sock)
    except (OSError, ConnectionError) as exc:
        conn.disconnect()
        if isinstance(exc, TimeoutError | socket.timeout):
            raise redis.TimeoutError(f"Redis {what} timed out: {exc}") from exc
        raise redis.ConnectionError(f"Redis {what} failed: {exc}") from exc
    except BaseException:
        conn.disconnect()
        raise
    finally:
        pool.release(conn)


def get_into(
    client: Any,
    names: Sequence[str],
    headers: Sequence[memoryview],
    outs: Sequence[memoryview],
) -> list[str]:
    """GET every name in one round trip; see the module docstring."""
    import redis

    request = b"".join(b"*2\r\n$3\r\nGET\r\n%s" % _bulk(name.encode()) for name in names)
    with _pooled(client, "read") as (sock, replies):
        sock.sendall(request)
        answers = [_one(replies, header, out) for header, out in zip(headers, outs, strict=True)]
    errors = [a for a in answers if a.startswith("error:")]
    if errors:
        raise redis.ResponseError(errors[0][len("error:") :])
    return answers


def set_from(client: Any, items: Sequence[tuple[str, Sequence[bytes | memoryview]]]) -> None:
    """SET every ``name`` to the concatenation of its parts, in one round trip, the
    parts handed to the kernel as they are (``sendmsg`` gathers them; TLS sockets
    send them one by one). Any error reply raises ``redis.ResponseError`` once every
    reply is consumed; socket errors as in :func:`get_into`."""
    import redis

    pieces: list[bytes | memoryview] = []
    for name, parts in items:
        nbytes = sum(memoryview(p).nbytes for p in parts)
        pieces.append(b"*3\r\n$3\r\nSET\r\n%s$%d\r\n" % (_bulk(name.encode()), nbytes))
        pieces.extend(parts)
        pieces.append(b"\r\n")
    with _pooled(client, "write") as (sock, replies):
        _send(sock, pieces)
        answers = [replies.line() for _ in items]
    bad = [a for a in answers if a != b"+OK"]
    if bad:
        raise redis.ResponseError(bad[0][1:].decode(errors="replace"))


def _bulk(data: bytes) -> bytes:
    """``data`` as a RESP bulk string."""
    return b"$%d\r\n%s\r\n" % (len(data), data)


_IOV_MAX = 512  # buffers per sendmsg (Linux allows 1024)


def _send(sock: socket.socket, pieces: list[bytes | memoryview]) -> None:
    """Write every piece, in order, with as few system calls as the socket allows."""
    if isinstance(sock, ssl.SSLSocket):
        for piece in pieces:
            sock.sendall(piece)
        return
    views = [memoryview(p).cast("B") for p in pieces]
    i = 0
    while i < len(views):
        sent = sock.sendmsg(views[i : i + _IOV_MAX])
        while i < len(views) and sent >= len(views[i]):
            sent -= len(views[i])
            i += 1
        if sent:
            views[i] = views[i][sent:]


def _one(replies: _Replies, header: memoryview, out: memoryview) -> str:
    line = replies.line()
    kind, rest = line[:1], line[1:]
    if kind == b"-":
        if rest.startswith(b"WRONGTYPE"):
            return "type"
        return f"error:{rest.decode(errors='replace')}"
    if kind == b"_":  # RESP3 null
        return "missing"
    if kind == b"!":  # RESP3 blob error
        message = bytearray(int(rest) + 2)
        replies.read_into(memoryview(message))
        return f"error:{message[:-2].decode(errors='replace')}"
    if kind != b"$":
        raise ConnectionError(f"unexpected Redis reply {line[:40]!r}")
    length = int(rest)
    if length < 0:
        return "missing"
    if not len(header) <= length <= len(header) + len(out):
        replies.skip(length + 2)
        return "size"
    replies.read_into(header)
    replies.read_into(out[: length - len(header)])
    replies.skip(2)  # CRLF
    return "ok" if length == len(header) + len(out) else f"short:{length - len(header)}"
