"""The node-shared host tier's wiring (``tiers/host_tier.py``, ``tiers/build.py``): a hit the
directory refuses at load time is a miss (recompute), never an error; which
configurations may name a share; the link's counters as metrics; an engine whose
chunks differ from a running share's is refused at start-up."""

from __future__ import annotations

import shutil
import tempfile
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from test_scheduler import Req, make, ok, store_prompt

from kvoffload.adapters.vllm.link_metrics import LINK_OUTCOMES, LinkCounters
from kvoffload.core.config.typed import OffloadConfig
from kvoffload.core.directory import Directory
from kvoffload.core.errors import ConfigError
from kvoffload.core.keys import ChunkKey, Namespace
from kvoffload.core.observe.anomalies import Anomaly
from kvoffload.core.observe.recorder import MetricsRecorder
from kvoffload.core.scheduler.request_state import Phase
from kvoffload.core.scheduler_types import StepInput
from kvoffload.share.launch import spawn_server
from kvoffload.share.meta import ShareGeometry
from kvoffload.share.paths import SharePaths
from kvoffload.tiers.build import open_directory
from kvoffload.tiers.registry import HOST, tier_spec
from kvoffload.tiers.spec import TierContext

NAMESPACE = Namespace("m", "l", "f32")


def context(chunk_bytes: int = 1024, session: bytes | None = None) -> TierContext:
    return TierContext(NAMESPACE, 1, chunk_bytes, 64, session=session)


def test_try_prepare_load_pins_hits_and_answers_none_for_a_miss_pinning_nothing() -> None:
    directory = Directory(4)
    a, b = ChunkKey(b"\x01" * 16), ChunkKey(b"\x02" * 16)
    prepared = directory.prepare_store([a])
    directory.complete_store(prepared.keys, True)
    assert directory.try_prepare_load([a, b]) is None
    assert directory.pinned_count == 0
    assert directory.try_prepare_load([a]) == prepared.slots
    assert directory.pinned_count == 1


def test_a_hit_lost_between_lookup_and_load_is_recomputed_not_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A share may lose a chunk to another engine's eviction after the lookup, or not
    answer: its ``try_prepare_load`` answers None, and the load becomes a load of
    invalid blocks (the engine recomputes them), with nothing pinned."""
    s, _ = make()
    store_prompt(s, Req("a", list(range(12))), [1, 2, 3])
    b = Req("b", list(range(12)))
    assert s.lookup(b, 0) == 12

    def lost(keys: Sequence[ChunkKey]) -> None:
        return None

    monkeypatch.setattr(s.directory, "try_prepare_load", lost)
    s.on_allocated(b, ([4, 5, 6],), 12)
    (load,) = s.build_plan(StepInput()).loads
    assert load.keys == () and load.invalid_blocks == (4, 5, 6)
    assert s.directory.pinned_count == 0
    s.on_report(ok([load]))
    state = s.state_of("b")
    assert state is not None and state.phase is Phase.RUNNING and state.load_failed
    assert s.anomalies.counts == {Anomaly.CHUNK_GONE: 1}
    s.check_integrity()


def test_the_host_share_follows_the_options_and_takes_a_lower_tier(tmp_path: Path) -> None:
    assert HOST.node_share(OffloadConfig.from_dict({"cpu_bytes": 1 << 20}), context()) is None
    config = OffloadConfig.from_dict(
        {
            "cpu_bytes": 1 << 20,
            "host_share": "node-a",
            "host_share_timeout_ms": 20,
            "host_share_root": str(tmp_path),
            "eviction": "slru",
        }
    )
    share = HOST.node_share(config, context())
    assert share is not None and share.paths == SharePaths("node-a", tmp_path)
    assert (share.geometry.num_slots, share.geometry.policy, share.timeout_s) == (
        1024, "slru", 0.02,
    )  # fmt: skip
    with_disk = OffloadConfig.from_dict(
        {
            "cpu_bytes": 1 << 20,
            "host_share": "node-a",
            "disk_path": str(tmp_path / "d"),
            "disk_bytes": 1 << 20,
        }
    )
    host = HOST.node_share(with_disk, context())
    assert host is not None and host.paths.name == "node-a"
    disk = tier_spec("disk").node_share(with_disk, context())  # shared too (decision 0017)
    assert disk is not None and disk.paths.name.startswith("disk-")


def test_link_counters_count_what_the_link_counted_since_the_last_reading() -> None:
    recorder = MetricsRecorder()
    counters = LinkCounters(recorder)
    assert all(recorder.value("host_share_calls_total", outcome=o) == 0 for o in LINK_OUTCOMES)
    stats: Counter[str] = Counter(connects=1, timeouts=2)
    counters.sync(stats)
    stats["timeouts"] += 3
    counters.sync(stats)
    counters.sync(stats)
    assert recorder.value("host_share_calls_total", outcome="connects") == 1
    assert recorder.value("host_share_calls_total", outcome="timeouts") == 5
    assert recorder.value("host_share_calls_total", outcome="lost") == 0


@pytest.fixture
def share_root() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="kvw-", dir="/tmp"))  # a short socket path
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_an_engine_whose_chunks_differ_from_the_share_s_slots_is_refused(
    share_root: Path,
) -> None:
    paths = SharePaths("sized", share_root)
    spawned = spawn_server(paths, ShareGeometry.for_budget(64 * 1024, 1024))
    assert spawned is not None
    try:
        assert spawned.wait_ready(60.0)
        config = OffloadConfig.from_dict(
            {"cpu_bytes": 64 * 1024, "host_share": "sized", "host_share_root": str(share_root)}
        )
        with pytest.raises(ConfigError) as refused:
            open_directory(HOST, config, context(2048, session=bytes(16)))
        assert refused.value.field == "host_share"
        index, opened = open_directory(HOST, config, context(1024, session=bytes(16)))
        try:
            assert opened is not None and index.index is opened.directory
            assert not opened.started and opened.directory.num_slots == 64
            assert "host share 'sized'" in opened.describe()
            assert "found running" in opened.describe()
        finally:
            index.close()
    finally:
        spawned.process.kill()
        spawned.process.wait()
        spawned.close()
