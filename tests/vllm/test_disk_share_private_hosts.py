"""Two harness engines over vLLM's real scheduler, each with its own host tier, sharing
one disk tier (``disk_share: node``, decision 0017): what one engine computed comes back
to the other from the shared disk, checked block by block against the KV model; with
``disk_share: off`` the second engine is refused at start."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvoffload.core.errors import ConfigError
from kvoffload.core.keys import ChunkKey
from kvoffload.testing.vllm_fuzz.shared_host import BLOCK_BYTES
from kvoffload.testing.vllm_harness import HarnessSpec, VllmHarness
from kvoffload.testing.vllm_harness.fleet_disk import DiskShareWatch, disk_directory
from kvoffload.tiers.disk import slot_bytes

PREFIX = list(range(10, 58))  # three chunks of 16 tokens
OTHER = list(range(200, 248))


@pytest.fixture
def roots(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """(the disk_path, a short root for the disk share's runtime files: a Unix
    socket's path holds at most 107 bytes)."""
    root = Path(tempfile.mkdtemp(prefix="kvp-", dir="/tmp"))
    try:
        yield tmp_path / "disk", root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def spec(disk: Path, root: Path, mode: str) -> HarnessSpec:
    extra: dict[str, Any] = {
        "chunk_tokens": 16,
        "disk_path": str(disk),
        "disk_bytes": 32 * slot_bytes(BLOCK_BYTES),
        "disk_share": mode,
        "host_share_root": str(root),
        "host_share_timeout_ms": 10_000,
    }
    return HarnessSpec(num_blocks=32, cpu_bytes=3 * BLOCK_BYTES, extra=extra)


def serve(h: VllmHarness, request_id: str, prompt: list[int]) -> None:
    h.add_request(request_id, prompt, 3)
    while h.busy():
        h.step()
    assert h.output_tokens(request_id) == h.model.reference_output(request_id, prompt, 3)


def test_private_host_tiers_share_one_disk_tier(tiny_model: Path, roots: tuple[Path, Path]) -> None:
    disk, root = roots
    watch = DiskShareWatch(disk, root, 10.0)
    made: list[VllmHarness] = []
    try:
        a = VllmHarness(tiny_model, spec(disk, root, "node"))
        made.append(a)
        b = VllmHarness(tiny_model, spec(disk, root, "node"))
        made.append(b)
        assert a.side.share is None and b.side.share is None  # private host tiers
        assert disk_directory(a) is not None and disk_directory(b) is not None
        spilled: set[ChunkKey] = set()  # tier reads judged against both engines' spills
        for unit in (*a.units, *b.units):
            unit.checks.share_spilled(spilled)
        watch.find()
        serve(a, "a", [*PREFIX, 1])
        serve(a, "a2", [*OTHER, 1])  # PREFIX leaves A's host tier, kept on disk
        counts = watch.counts()
        assert counts is not None and counts.chunks >= 6 and counts.sessions == 3
        serve(b, "b", [*PREFIX, 2])
        assert b.loaded_tokens("b") == len(PREFIX)  # B's KV checked block by block
        tier = b.scheduler_half.tiers.tier("disk")
        assert tier is not None
        moved = tier.metrics.breakdown("transferred_chunks_total", "direction")
        assert moved.get("load", 0) + moved.get("promote", 0) >= 1
        for h in made:
            h.quiescent()
        watch.check_bookings(made)
    finally:
        for h in made:
            h.close()
        watch.close()


def test_without_sharing_a_second_engine_on_the_path_is_refused(
    tiny_model: Path, roots: tuple[Path, Path]
) -> None:
    disk, root = roots
    a = VllmHarness(tiny_model, spec(disk, root, "off"))
    try:
        assert disk_directory(a) is None  # its own directory, under its lock
        with pytest.raises(ConfigError) as refused:
            VllmHarness(tiny_model, spec(disk, root, "off"))
        assert refused.value.field == "disk_path"
        assert "host_share" in str(refused.value)  # the message says how to share it
    finally:
        a.close()
