"""A bandwidth-limiting TCP proxy on the loopback interface, for benchmarks: a slower
link in front of a real server (``bench/e2e_slowtiers.py`` puts it before a private
redis-server).

The link: every connection accepted on ``127.0.0.1:<port>`` is forwarded to
``127.0.0.1:<target>``, both directions. Each direction is one token bucket shared by
every connection (a full-duplex link of ``rate`` bytes/s each way: many clients share
it, as they would a real link); the client-to-server direction also delays every
piece of data by ``latency`` seconds from its arrival (a one-way delay: requests in
flight overlap, they do not queue behind each other's delay), so a request-response
round trip costs ``latency`` once plus its bytes at ``rate``.

The bucket (:func:`take`, pure): it refills at ``rate`` up to ``burst`` bytes; a send
of ``n`` bytes spends ``n`` at once, possibly into debt, and waits until the debt is
paid. Senders that find a debt wait behind it, so the rate holds across connections.
``python bench/throttle_proxy.py --self-test`` checks that arithmetic (no sockets).

Lifetime: run as a child process (:class:`ThrottleProxy`, a context manager) so its
event loop never shares the GIL with an in-process engine. It listens only on
127.0.0.1, prints ``listening <port>`` once ready, and exits by itself when its stdin
closes (the parent closed it, or died), after ``--lifetime-s`` seconds at most, or on
SIGTERM; the parent closes stdin when its block ends (on failure too) and kills the
child by pid if it has not gone 5 s later.

Usage: ``python bench/throttle_proxy.py --target-port P --rate-bps R [--latency-ms L]
[--lifetime-s S]`` (serve) or ``--self-test``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from types import TracebackType

HOST = "127.0.0.1"  # the only address the proxy listens on or connects to
PIECE = 64 * 1024  # largest read forwarded at once
QUEUED_PIECES = 16  # per connection and direction: reads ahead of the link (backpressure)
BURST_S = 0.002  # the bucket holds this many seconds of rate, at least one piece's worth


# --- the token bucket (pure) ----------------------------------------------------


@dataclass(frozen=True)
class Bucket:
    """A token bucket of ``rate`` bytes/s holding at most ``burst`` bytes; ``tokens``
    (negative: a debt) as of ``stamp`` seconds."""

    rate: float
    burst: float
    tokens: float = 0.0
    stamp: float = 0.0


def make_bucket(rate: float, now: float) -> Bucket:
    """A full bucket of ``rate`` bytes/s at ``now``."""
    if not rate > 0:
        raise ValueError(f"rate must be > 0 bytes/s, got {rate}")
    burst = max(rate * BURST_S, float(PIECE))
    return Bucket(rate, burst, burst, now)


def take(bucket: Bucket, now: float, nbytes: int) -> tuple[Bucket, float]:
    """Spend ``nbytes`` at ``now``: (the bucket after, seconds to wait before sending).

    Refills for the time since its stamp (never backwards, never above ``burst``),
    then spends; a send that overdraws waits until the debt is paid at ``rate``."""
    elapsed = max(0.0, now - bucket.stamp)
    tokens = min(bucket.burst, bucket.tokens + elapsed * bucket.rate) - nbytes
    return replace(bucket, tokens=tokens, stamp=max(now, bucket.stamp)), max(
        0.0, -tokens / bucket.rate
    )


def due(arrival: float, latency: float) -> float:
    """When data that arrived at ``arrival`` may leave a link of one-way ``latency``."""
    return arrival + latency


class SharedBucket:
    """A :class:`Bucket` for several threads or tasks: :meth:`reserve` spends under a
    lock and says how long the caller waits (the caller sleeps, outside the lock)."""

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._bucket = make_bucket(rate, self._now())

    def _now(self) -> float:
        return self._clock()

    def reserve(self, nbytes: int) -> float:
        with self._lock:
            self._bucket, wait = take(self._bucket, self._now(), nbytes)
        return wait


def self_test() -> None:
    """The bucket's arithmetic, on made-up times (deterministic; no sockets)."""
    rate = 1000.0
    b = Bucket(rate, burst=100.0, tokens=100.0, stamp=0.0)
    b, wait = take(b, 0.0, 100)  # the burst goes at once
    assert wait == 0.0 and b.tokens == 0.0, (b, wait)
    b, wait = take(b, 0.0, 500)  # then 500 bytes wait 0.5 s
    assert abs(wait - 0.5) < 1e-12, wait
    b, wait = take(b, 0.5, 1000)  # back to back: the next 1000 wait 1 s more
    assert abs(wait - 1.0) < 1e-12, wait
    b, wait = take(b, 100.0, 10)  # a long idle refills only up to the burst
    assert wait == 0.0 and b.tokens == 90.0, (b, wait)
    b, wait = take(b, 50.0, 10)  # a stale clock never refills backwards
    assert b.stamp == 100.0 and b.tokens == 80.0, b
    # A steady sender: n pieces of p bytes, each sent when allowed, take (n*p - burst) / rate.
    b, now = Bucket(rate, burst=100.0, tokens=100.0), 0.0
    for _ in range(50):
        b, wait = take(b, now, 200)
        now += wait
    assert abs(now - (50 * 200 - 100) / rate) < 1e-9, now
    assert due(1.0, 0.002) == 1.002
    full = make_bucket(1e9, 5.0)  # a fast link: burst = 2 ms of rate
    assert full.burst == 2e6 and full.tokens == full.burst and full.stamp == 5.0
    assert make_bucket(1.0, 0.0).burst == PIECE  # a slow one: one piece
    try:
        make_bucket(0.0, 0.0)
    except ValueError:
        pass
    else:
        raise AssertionError("rate 0 accepted")
    print("throttle_proxy self-test: ok")


# --- the proxy (child process) ----------------------------------------------------


class Link:
    """The two directions' buckets and the client-to-server delay (one per proxy)."""

    def __init__(self, rate: float, latency: float) -> None:
        self.up = SharedBucket(rate)
        self.down = SharedBucket(rate)
        self.latency = latency


async def _read(
    reader: asyncio.StreamReader, queue: asyncio.Queue[tuple[float, bytes]], delayed: bool
) -> None:
    while True:
        data = await reader.read(PIECE)
        await queue.put((time.monotonic() if delayed else 0.0, data))
        if not data:
            return


async def _send(
    queue: asyncio.Queue[tuple[float, bytes]],
    writer: asyncio.StreamWriter,
    bucket: SharedBucket,
    latency: float,
) -> None:
    while True:
        arrival, data = await queue.get()
        if not data:
            with contextlib.suppress(OSError):
                writer.write_eof()
            return
        if latency:
            await asyncio.sleep(max(0.0, due(arrival, latency) - time.monotonic()))
        wait = bucket.reserve(len(data))
        if wait:
            await asyncio.sleep(wait)
        writer.write(data)
        await writer.drain()


async def _pipe(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    bucket: SharedBucket,
    latency: float,
) -> None:
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(QUEUED_PIECES)
    await asyncio.gather(_read(reader, queue, bool(latency)), _send(queue, writer, bucket, latency))


async def _connection(
    link: Link, target_port: int, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter
) -> None:
    server_w = None
    try:
        server_r, server_w = await asyncio.open_connection(HOST, target_port)
        await asyncio.gather(
            _pipe(client_r, server_w, link.up, link.latency),
            _pipe(server_r, client_w, link.down, 0.0),
        )
    except (OSError, asyncio.IncompleteReadError):
        pass  # either side went away: close both
    except asyncio.CancelledError:
        pass  # the proxy is stopping: close both, quietly (the task ends normally)
    finally:
        for w in (client_w, server_w):
            if w is not None:
                w.close()


def _stdin_closed() -> bool:
    """True once the parent closed our stdin (or died): EOF is readable."""
    readable, _, _ = select.select([sys.stdin], [], [], 0)
    return bool(readable) and not os.read(sys.stdin.fileno(), 4096)


async def serve(target_port: int, rate: float, latency: float, lifetime: float) -> None:
    link = Link(rate, latency)
    server = await asyncio.start_server(
        lambda r, w: _connection(link, target_port, r, w), HOST, 0, reuse_address=True
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    port = server.sockets[0].getsockname()[1]
    print(f"listening {port}", flush=True)
    deadline = time.monotonic() + lifetime
    async with server:
        while not stop.is_set() and time.monotonic() < deadline and not _stdin_closed():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.2)
        server.close()


# --- the parent's handle ----------------------------------------------------------


class ThrottleProxy:
    """A proxy child process in front of ``127.0.0.1:target_port`` (see the module
    docstring). ``with ThrottleProxy(...) as proxy:`` -> ``proxy.port``; the child is
    gone when the block ends, on failure too."""

    def __init__(
        self, target_port: int, rate_bps: float, latency_s: float = 0.0, lifetime_s: float = 3600
    ) -> None:
        self.args = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--target-port",
            str(target_port),
            "--rate-bps",
            repr(float(rate_bps)),
            "--latency-ms",
            repr(latency_s * 1000),
            "--lifetime-s",
            repr(float(lifetime_s)),
        ]
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0

    def start(self) -> ThrottleProxy:
        self.proc = subprocess.Popen(self.args, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        try:
            assert self.proc.stdout is not None
            ready, _, _ = select.select([self.proc.stdout], [], [], 30)
            line = self.proc.stdout.readline().decode() if ready else ""
            if not line.startswith("listening "):
                raise RuntimeError(f"throttle proxy did not start (said {line!r})")
            self.port = int(line.split()[1])
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Close the child's stdin (it exits), wait 5 s, then SIGKILL it by pid."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()

    def __enter__(self) -> ThrottleProxy:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--self-test", action="store_true", help="check the bucket arithmetic")
    parser.add_argument("--target-port", type=int, help="forward to 127.0.0.1:PORT")
    parser.add_argument("--rate-bps", type=float, help="bytes/s each way, shared by connections")
    parser.add_argument("--latency-ms", type=float, default=0.0, help="client-to-server delay")
    parser.add_argument("--lifetime-s", type=float, default=3600.0, help="exit after this long")
    args = parser.parse_args(argv)
    if args.self_test:
        self_test()
        return 0
    if args.target_port is None or args.rate_bps is None:
        parser.error("--target-port and --rate-bps are required (or --self-test)")
    asyncio.run(serve(args.target_port, args.rate_bps, args.latency_ms / 1000, args.lifetime_s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
