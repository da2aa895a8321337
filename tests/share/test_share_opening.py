"""Opening a share from an engine's configuration: the first engine starts the node
process, its workers map their slabs and lease the engine's session, and an engine
whose chunks do not fit is refused at start-up."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from share_fixtures import host_share, open_host_directory

from kvoffload.core.errors import ConfigError
from kvoffload.core.keys import ChunkKey
from kvoffload.share.lease import Lease
from kvoffload.tiers.host_shared import SharedHostSlab


def test_the_share_comes_from_the_extra_config(share_root: Path) -> None:
    share = host_share(
        {"host_share": "s", "cpu_bytes": 1 << 20, "eviction": "arc",
         "host_share_timeout_ms": 2, "host_share_root": str(share_root)},
        chunk_bytes=4096, ranks=2,
    )  # fmt: skip
    assert (share.paths.socket, share.geometry.policy, share.timeout_s) == (
        share_root / f"kvoffload-u{os.geteuid()}" / "s" / "sock", "arc", 0.002,
    )  # fmt: skip
    assert share.geometry.num_slots == 128 and share.bind_plans
    for bad, key in (
        ({"host_share": "s"}, "cpu_bytes"),
        ({"host_share": "s", "cpu_bytes": 1, "host_share_timeout_ms": 0}, "timeout"),
        ({"host_share": "a b", "cpu_bytes": 1}, "host_share"),
    ):
        with pytest.raises(ConfigError, match=key):
            host_share(bad, chunk_bytes=4096)


def test_an_engine_opens_a_share_that_its_workers_map(share_root: Path) -> None:
    config = {"host_share": "open", "cpu_bytes": 8 * 4096, "host_share_root": str(share_root)}
    share = host_share(config, chunk_bytes=4096, ranks=2)
    directory = open_host_directory(share)
    assert directory.link.welcome is not None
    pid = directory.link.welcome.pid
    try:
        slabs = [
            SharedHostSlab(host_share(config, chunk_bytes=4096, ranks=2, rank=r),
                           chunk_bytes=4096, rank=r)
            for r in range(2)
        ]  # fmt: skip
        leases = [Lease(share.paths, directory.session) for _ in slabs]
        assert all(lease.connected.wait(30.0) for lease in leases)
        counts = directory.share_counts()
        assert counts is not None and counts.sessions == 1 and counts.num_slots == 4
        key = ChunkKey(bytes(15) + b"\x01")
        prepared = directory.prepare_store([key])
        for rank, slab in enumerate(slabs):
            slab.slot_bytes(prepared.slots[0])[:] = bytes([rank + 1]) * 4096
        directory.complete_store(prepared.keys, success=True)
        assert directory.readable_prefix([key]) == 1
        with pytest.raises(ConfigError, match="4096 B per rank"):
            open_host_directory(host_share(config, chunk_bytes=2048, ranks=2))
        for lease, slab in zip(leases, slabs, strict=True):
            lease.close()
            slab.close()
    finally:
        directory.close()
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
