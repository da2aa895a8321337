"""The share's announcement feed at scale: what a node process pays per chunk and what
an engine's announcer reads, against a share of up to millions of chunks.

Runs a node process's :class:`~kvoffload.share.feed.ShareFeed` in this process (no
sockets: the feed's own cost) with ``--chunks`` records of ``--record-bytes`` each
(a 256-token chunk of 8 blocks is about 2.5 KB: int64 token ids and 32-byte hashes),
and measures, medians of ``--rounds``:

- ``announce``: records kept per second (one ``ANNOUNCE`` batch of 1,024);
- ``removed``: removals logged per second;
- ``feed``: an up-to-date cursor's ``FEED`` read of one batch of changes (1,024
  stored), bytes and seconds (what every engine does every ``share_announce_ms``);
- ``snapshot`` + ``records``: a late attacher's full read (keys, then records 1,024
  at a time), seconds and bytes, over the whole share;
- memory: the records' bytes and the feed's Python overhead per chunk (tracemalloc).

Then the same over a served node process through a :class:`FeedReader` (a Unix
socket): one late attacher's full read of ``--served-chunks`` chunks.

    PYTHONPATH=src python bench/share_feed.py [--chunks 1000000] [--record-bytes 2500]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path

from kvoffload.core.keys import ChunkKey
from kvoffload.share.feed import ShareFeed
from kvoffload.share.feed_reader import FeedReader
from kvoffload.share.meta import ShareGeometry
from kvoffload.share.paths import SharePaths
from kvoffload.share.server_start import open_server

BATCH = 1024


def keys(n: int, first: int = 0) -> list[ChunkKey]:
    return [ChunkKey((first + i).to_bytes(8, "little") * 2) for i in range(n)]


def records(batch: list[ChunkKey], record: bytes) -> list[tuple[ChunkKey, bytes]]:
    """A distinct record per key (the memory measured is the records' own)."""
    return [(k, record[:-16] + k) for k in batch]


def in_process(chunks: int, record_bytes: int, rounds: int) -> None:
    record = os.urandom(record_bytes)
    all_keys = keys(chunks)
    tracemalloc.start()
    feed = ShareFeed(epoch=1)
    start = time.perf_counter()
    for i in range(0, chunks, BATCH):
        batch = all_keys[i : i + BATCH]
        feed.announce(b"ns", records(batch, record), batch)
    announce_s = time.perf_counter() - start
    current, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    print(f"{chunks} records of {record_bytes} B kept: {chunks / announce_s:,.0f} records/s; "
          f"memory {current / chunks:,.0f} B per chunk "
          f"({(current / chunks) - record_bytes:,.0f} B beyond the record)")  # fmt: skip
    feeds, snaps = [], []
    for r in range(rounds):
        cursor = feed.read(b"ns", 0, 1, 1)  # the head: a reader that is up to date
        head = int.from_bytes(cursor[:8], "little")
        fresh = keys(BATCH, first=chunks + r * BATCH)
        feed.announce(b"ns", records(fresh, record), fresh)
        start = time.perf_counter()
        reply = feed.read(b"ns", head, 1, 1 << 30)
        feeds.append((time.perf_counter() - start, len(reply)))
        start = time.perf_counter()
        snap = feed.snapshot(b"ns")
        got = 16
        listed = [ChunkKey(snap[i : i + 16]) for i in range(16, len(snap), 16)]
        for i in range(0, len(listed), BATCH):
            got += len(feed.records(b"ns", listed[i : i + BATCH]))
        snaps.append((time.perf_counter() - start, len(snap) + got))
        feed.removed(fresh)
    start = time.perf_counter()
    feed.removed(all_keys[: chunks // 2])
    removed_s = time.perf_counter() - start
    f_s, f_b = statistics.median(s for s, _ in feeds), statistics.median(b for _, b in feeds)
    s_s, s_b = statistics.median(s for s, _ in snaps), statistics.median(b for _, b in snaps)
    print(f"removals logged: {chunks // 2 / removed_s:,.0f} /s")
    print(f"FEED of {BATCH} new chunks: {f_s * 1e3:.2f} ms, {f_b / 1e6:.2f} MB "
          f"({f_b / BATCH:,.0f} B per chunk)")  # fmt: skip
    print(f"late attacher's full read of {chunks} chunks: {s_s:.2f} s, {s_b / 1e9:.2f} GB")


def served(chunks: int, record_bytes: int) -> None:
    root = Path(tempfile.mkdtemp(prefix="kvoffload-feed-"))
    paths = SharePaths("feedbench", root)
    server = open_server(paths, ShareGeometry(num_slots=chunks, slot_bytes=64))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        record = os.urandom(record_bytes)
        all_keys = keys(chunks)
        server.book.feed.announce(b"ns", records(all_keys, record), all_keys)
        reader = FeedReader(paths, os.urandom(16), b"ns", timeout_s=60.0)
        start = time.perf_counter()
        update = reader.poll()
        took = time.perf_counter() - start
        assert update.full and len(update.stored) == chunks
        print(f"served: a late attacher read {chunks} chunks' records over the socket in "
              f"{took:.2f} s ({chunks / took:,.0f} chunks/s)")  # fmt: skip
        reader.close()
    finally:
        server.stop()
        thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=1_000_000)
    parser.add_argument("--record-bytes", type=int, default=2500)
    parser.add_argument("--served-chunks", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    in_process(args.chunks, args.record_bytes, args.rounds)
    served(args.served_chunks, args.record_bytes)


if __name__ == "__main__":
    main()
