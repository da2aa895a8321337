"""A real vLLM engine whose node-shared host tier is deleted under it (decision 0018):
the share root's per-user directory removed wholesale, as systemd's ``RemoveIPC``
does to /dev/shm. The engine keeps serving; the next node process makes new slab
files; a new engine that maps them and loads what the first one stored afterwards
answers exactly as the first one computed (issue 30, bug 4: it used to load the new
file's zero bytes). Engines run in processes of their own (``share_support.Child``),
stopped by pid at the end, as is every node process."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
from pathlib import Path

from llm_support import BLOCK, CHUNK_BYTES, PROMPTS
from share_support import Child, share_config, stop_node_process

from kvoffload.share.client import ShareDirectory
from kvoffload.share.lifecycle import recorded_pid
from kvoffload.share.paths import SharePaths
from kvoffload.share.queries import ShareCounts

SHARE_CHUNKS = 64
FRESH = [[(11 * p + 5 * i) % 991 + 3 for i in range(8 * BLOCK)] for p in range(24)]
"""Prompts nothing stored before, served one by one until A stored one into the new
share: how many that takes is the client's reconnect timing (its back-off, the new
node process's start), so the bound is generous (six were sometimes too few)."""


def share_counts(paths: SharePaths) -> ShareCounts | None:
    """The share's counts, or None while no node process answers."""
    client = ShareDirectory(
        paths, start_server=False, lease=False, users=False, fence=False, timeout_s=5.0
    )
    try:
        return client.share_counts() if client.wait_ready(5.0) else None
    finally:
        client.close()


def test_a_share_deleted_under_a_live_engine_never_serves_its_dead_mapping(
    tiny_model: Path, tmp_path: Path, children: list[Child]
) -> None:
    extra = share_config(tmp_path / "shm", f"wipe-{os.getpid()}", SHARE_CHUNKS * CHUNK_BYTES)
    paths = SharePaths(extra["host_share"], Path(extra["host_share_root"]))
    first_node: int | None = None
    try:
        a = Child(tiny_model, extra, tmp_path / "a.log")
        children.append(a)
        before = a.ask(prompts=[PROMPTS[0]])  # stored in the share's first slab files
        assert before["host_hit_tokens"] == 0
        first_node = recorded_pid(paths)
        for _ in range(100):  # what RemoveIPC does, under the live engine (again while
            shutil.rmtree(paths.user_dir, ignore_errors=True)  # its reconnecting lease
            if not paths.user_dir.exists():  # thread made its users.lock anew in it)
                break
        assert not paths.user_dir.exists()
        served = []
        for prompt in FRESH:  # A computes them (nothing stored them before) and stores
            served.append(a.ask(prompts=[prompt]))  # them once its slab is the new one
            left = share_counts(paths)
            if left is not None and left.chunks > 0:
                break
        assert all(s["host_hit_tokens"] == 0 for s in served)
        assert left is not None and left.chunks > 0, "A stored nothing into the new share"
        b = Child(tiny_model, extra, tmp_path / "b.log")  # maps the new slab files
        children.append(b)
        # The prompt A stored into the new share (those before it found no node
        # process), and the first one; not every served prompt: B's own stores of
        # those would evict A's chunks from the 64-chunk share first.
        again = b.ask(prompts=[FRESH[len(served) - 1], PROMPTS[0]])
        assert again["tokens"] == [served[-1]["tokens"][0], before["tokens"][0]]
        assert again["host_hit_tokens"] >= BLOCK, again  # loaded what A stored since
        assert a.close() == 0 and b.close() == 0
        left = share_counts(paths)
        assert left is not None and (left.pinned, left.storing) == (0, 0)
    finally:
        stop_node_process(extra)
        if first_node is not None:  # it leaves on its own once its files are gone
            with contextlib.suppress(OSError):
                if b"kvoffload.share.serve" in Path(f"/proc/{first_node}/cmdline").read_bytes():
                    os.kill(first_node, signal.SIGKILL)
