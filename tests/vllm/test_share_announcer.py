"""Every engine on a node share announces what the share holds (``share_announcer.py``),
step by step: engine A's translator makes a record of a chunk it stored into the
share, A's announcer sends it, engine B's announcer reads the feed and publishes
vLLM's ``BlockStored`` (medium ``CPU``) with A's block hashes, parent and token ids;
the share's eviction becomes B's ``BlockRemoved``; a record that does not describe its
key (corrupt, another geometry, another prefix's tokens under the chunk's hashes, another
first-block hash) is counted and never published; a prefix-cache reset
re-announces everything after vLLM's ``AllBlocksCleared`` (the next step's events).
Node processes are served from threads; announcers are driven round by round
(``start=False``), events taken from their sinks: no sleeps."""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from msgspec.structs import replace
from request_identities import EXTRA_KEYS
from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
    maybe_convert_block_hash,
)
from vllm.v1.request import Request

from kvoffload.adapters.vllm import share_records
from kvoffload.adapters.vllm.block_hasher import VllmBlockHasher
from kvoffload.adapters.vllm.event_sink import EventSink
from kvoffload.adapters.vllm.events import EventTranslator, event_keys
from kvoffload.adapters.vllm.share_announcer import ShareAnnouncer
from kvoffload.core.jobs import EngineJob, JobKind
from kvoffload.core.keys import ChunkKey, KeyChain, Namespace, next_key
from kvoffload.core.kv_groups import ONE_GROUP
from kvoffload.core.observe.events import CacheEvent, EventKind
from kvoffload.share.client import ShareDirectory
from kvoffload.share.feed_reader import FeedReader
from kvoffload.share.meta import ShareGeometry
from kvoffload.share.paths import SharePaths
from kvoffload.share.server_start import open_server
from vllm import SamplingParams

BLOCK = 16
BLOCKS = 6
PER_CHUNK = 2
NS = Namespace("announce-test@1", "layout", "fp32")


class ThreadShares:
    """Node processes served from threads of the test, and engine A's directories."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.stops: list[Any] = []

    def serve(self, name: str, geometry: ShareGeometry) -> SharePaths:
        paths = SharePaths(name, self.root)
        server = open_server(paths, geometry)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        self.stops.append(lambda: (server.stop(), thread.join()))
        return paths

    def client(self, paths: SharePaths) -> ShareDirectory:
        client = ShareDirectory(paths, namespace=b"ns", lease=False, users=False,
                                start_server=False, timeout_s=30.0)  # fmt: skip
        assert client.wait_ready(30.0)
        self.stops.insert(0, client.close)
        return client


@pytest.fixture
def shares(tmp_path: Path) -> Iterator[ThreadShares]:
    root = tmp_path / "s"
    root.mkdir()
    threads = ThreadShares(root)
    yield threads
    for stop in threads.stops:
        stop()


def request(first: int = 1, **identity: Any) -> Request:
    init_none_hash(sha256)
    return Request(
        "r",
        [(5 * i + first) % 500 + 1 for i in range(BLOCKS * BLOCK)],
        SamplingParams(max_tokens=1),
        None,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
        **identity,
    )


def tokens_of(ids: list[int]) -> bytes:
    return b"".join(t.to_bytes(8, "little", signed=True) for t in ids)


HASHER = VllmBlockHasher("sha256")


class CountingHasher(VllmBlockHasher):
    def __init__(self) -> None:
        super().__init__("sha256")
        self.blocks = 0

    def block(self, parent: bytes | None, tokens: Any, keys: Any) -> bytes:
        self.blocks += 1
        return super().block(parent, tokens, keys)


def translator() -> EventTranslator:
    return EventTranslator(BLOCK, PER_CHUNK, maybe_convert_block_hash,
                           shared_tiers=frozenset({"host"}), hasher=HASHER)  # fmt: skip


def stored_by_a(req: Request, a_dir: Any, a_events: EventTranslator) -> list[ChunkKey]:
    """A stores ``req``'s chunks into the share and its translator makes their records."""
    chain = KeyChain(NS, PER_CHUNK)
    keys = list(chain.extend(req.block_hashes))
    job = EngineJob(1, JobKind.STORE, "r", tuple(keys), (0, 1, 2), tuple(range(BLOCKS)), 2)
    a_events.note_jobs([job], {"r": (keys, req, chain.seed)})
    prepared = a_dir.prepare_store(keys)
    a_dir.complete_store(list(prepared.keys), True)
    assert a_events.translate([CacheEvent(EventKind.STORED, tuple(keys), "host")]) == []
    return keys


def announcer(paths: SharePaths, session: bytes, events: EventTranslator) -> ShareAnnouncer:
    reader = FeedReader(paths, session, b"ns", timeout_s=30.0)
    return ShareAnnouncer(events, {"host": reader}, EventSink(None), start=False)


def test_b_announces_what_a_stored_and_what_the_share_evicted(shares: ThreadShares) -> None:
    paths = shares.serve("announce", ShareGeometry(num_slots=4, slot_bytes=4096))
    a_dir = shares.client(paths)
    a_events, b_events = translator(), translator()
    b_events.hasher = counting = CountingHasher()
    a = announcer(paths, a_dir.session, a_events)
    b = announcer(paths, os.urandom(16), b_events)
    try:
        req = request()
        keys = stored_by_a(req, a_dir, a_events)
        a.queue_records(a_events.take_outbox())
        a.round()
        b.round()
        published = b.sink.take()
        assert [type(e) for e in published] == [BlockStored] * 3
        hashes = [maybe_convert_block_hash(h) for h in req.block_hashes]
        assert [e.block_hashes for e in published] == [hashes[i : i + 2] for i in (0, 2, 4)]
        assert [e.parent_block_hash for e in published] == [None, hashes[1], hashes[3]]
        assert published[0].token_ids == req.all_token_ids[: PER_CHUNK * BLOCK]
        assert {(e.medium, e.locality, e.ownership) for e in published} == {("CPU", "LOCAL", None)}
        assert a.sink.take() == published  # A announces its own chunks from the feed too
        # Another request's two chunks evict two of the first's (four slots).
        other = request(first=7)
        stored_by_a(other, a_dir, a_events)
        a.queue_records(a_events.take_outbox())
        a.round()
        b.round()
        events = b.sink.take()
        removed = [e for e in events if isinstance(e, BlockRemoved)]
        assert len(removed) == 2 and all(e.medium == "CPU" for e in removed)
        assert {h for e in removed for h in e.block_hashes} <= set(hashes)
        assert b.stats["bad_records"] == 0
        assert len(b.announced["host"]) == 4 and set(b.announced["host"]) & set(keys)
        # A reset of vLLM's prefix cache: everything held, again, at the next step only,
        # from the same records, which are not hashed again.
        checked = counting.blocks
        b.reannounce()
        b.round()
        again = b.sink.take()
        assert sorted(len(e.block_hashes) for e in again) == [2] * 4
        assert counting.blocks == checked > 0
        assert b.sink.deferred >= 4 and b.sink.direct == 0  # no publisher: the step path
    finally:
        a.close()
        b.close()


def test_a_record_that_is_not_its_chunks_is_counted_never_published(
    shares: ThreadShares,
) -> None:
    paths = shares.serve("announce-bad", ShareGeometry(num_slots=4, slot_bytes=4096))
    a_dir = shares.client(paths)
    a_events = translator()
    b = announcer(paths, os.urandom(16), translator())
    a_reader = FeedReader(paths, a_dir.session, b"ns", timeout_s=30.0)
    try:
        keys = stored_by_a(request(), a_dir, a_events)
        records = dict(a_events.take_outbox()["host"])
        good = records[keys[1]]
        # The chunk's own hashes with another prefix's tokens (what a router that
        # indexes token ids would credit this engine with).
        mine = share_records.decode(good, keys[1], ONE_GROUP, PER_CHUNK, BLOCK, hasher=HASHER)
        assert mine is not None
        other = tokens_of(request(first=7).all_token_ids[: PER_CHUNK * BLOCK])
        a_reader.send_records([
            (keys[0], records[keys[2]]),  # another chunk's record
            (keys[1], share_records.encode(replace(mine, tokens=other))),  # other tokens
            (keys[2], b"\x93\x01\x02\x03"),  # msgpack, not a record
        ])  # fmt: skip
        b.round()
        assert b.sink.take() == [] and b.stats["bad_records"] == 3
    finally:
        b.close()
        a_reader.close()


def test_records_decode_only_for_the_geometry_and_key_they_were_made_for() -> None:
    events = translator()
    req = request()
    chain = KeyChain(NS, PER_CHUNK)
    keys = list(chain.extend(req.block_hashes))
    job = EngineJob(1, JobKind.STORE, "r", tuple(keys), (0, 1, 2), tuple(range(BLOCKS)), 2)
    events.note_jobs([job], {"r": (keys, req, chain.seed)})
    events.translate([CacheEvent(EventKind.STORED, tuple(keys), "host")])
    (key, data), *_ = events.take_outbox()["host"]
    record = share_records.decode(data, key, ONE_GROUP, PER_CHUNK, BLOCK, hasher=HASHER)
    assert record is not None and record.token_ids() == req.all_token_ids[: PER_CHUNK * BLOCK]
    for geometry in ((PER_CHUNK + 1, BLOCK), (PER_CHUNK, BLOCK * 2)):
        assert share_records.decode(data, key, ONE_GROUP, *geometry, hasher=HASHER) is None
    assert share_records.decode(data, keys[1], ONE_GROUP, PER_CHUNK, BLOCK, hasher=HASHER) is None
    assert share_records.decode(b"", key, ONE_GROUP, PER_CHUNK, BLOCK, hasher=HASHER) is None


IDENTITIES = EXTRA_KEYS


@pytest.mark.parametrize("identity", IDENTITIES.values(), ids=IDENTITIES.keys())
def test_records_of_lora_salted_and_multimodal_chunks_verify_with_vllms_hasher(
    identity: dict[str, Any],
) -> None:
    """Every record of a request with extra keys verifies, and publishes the extra keys
    in vLLM's event form; the same record with another salt (or adapter name) does not."""
    events = translator()
    req = request(**identity)
    chain = KeyChain(NS, PER_CHUNK)
    keys = list(chain.extend(req.block_hashes))
    job = EngineJob(1, JobKind.STORE, "r", tuple(keys), (0, 1, 2), tuple(range(BLOCKS)), 2)
    events.note_jobs([job], {"r": (keys, req, chain.seed)})
    published = events.translate([CacheEvent(EventKind.STORED, tuple(keys), "disk")])
    events.translate([CacheEvent(EventKind.STORED, tuple(keys), "host")])
    records = dict(events.take_outbox()["host"])
    reader = translator()
    for key, event in zip(keys, published, strict=True):
        record = reader.read_record(key, records[key])
        assert record is not None
        assert isinstance(event, BlockStored) and event.extra_keys is not None
        assert event_keys(record.hashed_keys()) == event.extra_keys  # what B publishes
    first = reader.read_record(keys[0], records[keys[0]])
    assert first is not None
    hashed = first.hashed_keys()
    assert hashed is not None and hashed[0] is not None
    changed = tuple(
        tuple(("cache_salt", "tenant-z") if part[0] == "cache_salt" else part for part in block)
        if block is not None else None
        for block in hashed
    )  # fmt: skip
    other_salt = replace(first, block_keys=list(changed))
    assert reader.read_record(keys[0], share_records.encode(other_salt)) is None
    if first.lora is not None:
        renamed = replace(first, lora=(first.lora[0], "adapter-b"))
        assert reader.read_record(keys[0], share_records.encode(renamed)) is None


def test_a_record_chained_from_another_first_block_hash_is_not_announced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With a non-cryptographic hash and no PYTHONHASHSEED, vLLM draws its first-block
    hash per process: another process's records (or this one's before a restart) name
    another root, and none of their chunks is announced, later ones included."""
    from vllm.v1.core import kv_cache_utils

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    hasher = VllmBlockHasher("xxhash")
    monkeypatch.setattr(kv_cache_utils, "NONE_HASH", b"a" * 16)
    before = hasher.root()
    parent = b"p" * 16
    tokens = list(range(PER_CHUNK * BLOCK))
    hashes = [hasher.block(parent, tokens[:BLOCK], None)]
    hashes.append(hasher.block(hashes[0], tokens[BLOCK:], None))
    seed = ChunkKey(bytes(16))
    key = ONE_GROUP.key(next_key(seed, hashes), 0)
    data = share_records.encode(share_records.ChunkRecord(
        share_records.FORMAT, seed, hashes, parent, tokens_of(tokens), 0, None, None, None,
        before or b"",
    ))  # fmt: skip
    read = functools.partial(share_records.decode, data, key, ONE_GROUP, PER_CHUNK, BLOCK)
    assert read(hasher=hasher) is not None
    monkeypatch.setattr(kv_cache_utils, "NONE_HASH", b"b" * 16)  # a restart drew another
    assert hasher.root() != before and read(hasher=hasher) is None
    monkeypatch.setenv("PYTHONHASHSEED", "7")  # one seed for all: one root, known at once
    monkeypatch.delattr(kv_cache_utils, "NONE_HASH")
    assert hasher.root() == VllmBlockHasher("xxhash").root() is not None


def test_vllms_default_hash_gives_every_process_the_same_root(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm.v1.core import kv_cache_utils

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    monkeypatch.delattr(kv_cache_utils, "NONE_HASH", raising=False)  # not drawn yet
    hasher = VllmBlockHasher("sha256")
    init_none_hash(sha256)
    assert hasher.none_hash() == kv_cache_utils.NONE_HASH
    tokens = list(range(BLOCK))
    assert hasher.block(None, tokens, None) == kv_cache_utils.hash_block_tokens(
        sha256, None, tokens, None
    )
