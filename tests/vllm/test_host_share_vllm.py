"""Real vLLM engines in separate processes on one node-shared host tier
(``host_share``, decision 0016): tiny Llama, float32, greedy, no disk or Redis.

Each engine runs in a child process (:class:`share_support.Child`) answering
commands one JSON line at a time. The test waits on those lines and on process
exits, never on time. Every child and the share's node process are stopped by pid
at the end, on failure too.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from llm_support import CHUNK_BYTES, PROMPTS
from share_support import Child, counts, share_config, stop_node_process

from kvoffload.share.paths import SharePaths
from kvoffload.share.slab_files import HEADER_BYTES

MARK = "KVSHARE "
HERE = Path(__file__).resolve()
SHARE_CHUNKS = 64  # room for every prompt used here: nothing is evicted


@pytest.fixture
def share(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A share's configuration under a private root; its node process is stopped by
    pid at the end."""
    extra = share_config(tmp_path / "shm", f"wire-{os.getpid()}", SHARE_CHUNKS * CHUNK_BYTES)
    try:
        yield extra
    finally:
        stop_node_process(extra)


def slab_bytes(extra: dict[str, Any]) -> int:
    """Bytes of slots in the share's slab files (each also holds a small header)."""
    share_dir = SharePaths(extra["host_share"], Path(extra["host_share_root"])).dir
    files = [p for p in share_dir.iterdir() if p.name.startswith("slab.")]
    assert len(files) == 1  # one rank
    return sum(p.stat().st_size - HEADER_BYTES for p in files)


def test_engine_b_is_served_from_what_engine_a_stored(
    tiny_model: Path, tmp_path: Path, share: dict[str, Any], children: list[Child]
) -> None:
    prompts = PROMPTS[:2]
    reference = Child(tiny_model, None, tmp_path / "reference.log")
    children.append(reference)
    expected = reference.ask(prompts=prompts)["tokens"]
    assert reference.close() == 0

    a = Child(tiny_model, share, tmp_path / "a.log")
    children.append(a)
    first = a.ask(prompts=prompts)
    assert first["tokens"] == expected
    assert first["host_hit_tokens"] == 0  # nothing was stored before

    b = Child(tiny_model, share, tmp_path / "b.log")  # A still runs
    children.append(b)
    second = b.ask(prompts=prompts)
    assert second["tokens"] == expected
    # B's own prefix cache is cold: every hit is a load from the share, here every
    # chunk of both prompts.
    assert second["host_hit_tokens"] == sum(len(p) for p in prompts), second
    assert second["cached"] == [len(p) for p in prompts], second
    assert second["share_calls"]["connects"] >= 1 and second["share_calls"]["timeouts"] == 0

    assert slab_bytes(share) <= share["cpu_bytes"]  # one share, not one per engine
    assert a.close() == 0 and b.close() == 0
    left = counts(share)
    assert left is not None and left.pinned == 0 and left.storing == 0
    assert left.chunks == len(prompts) * 8  # stored once, though both engines ran them


def test_a_killed_engine_leaves_the_others_serving_and_a_restart_warm(
    tiny_model: Path, tmp_path: Path, share: dict[str, Any], children: list[Child]
) -> None:
    stream = PROMPTS[1:4]
    reference = Child(tiny_model, None, tmp_path / "reference.log")
    children.append(reference)
    expected = reference.ask(prompts=[PROMPTS[0], *stream])["tokens"]
    assert reference.close() == 0

    a = Child(tiny_model, share, tmp_path / "a.log")
    children.append(a)
    assert a.ask(prompts=[PROMPTS[0]])["tokens"] == expected[:1]  # stored (settled)
    b = Child(tiny_model, share, tmp_path / "b.log")
    children.append(b)
    # A serves a stream one request at a time without waiting for its stores; it is
    # killed as soon as it answered the first one (its stores in flight or not).
    a.send(prompts=stream, stream=True, settle=False)
    assert a.read()["tokens"] == expected[1:2]
    a.kill()

    served = b.ask(prompts=[PROMPTS[0], *stream])
    assert served["tokens"] == expected
    assert served["host_hit_tokens"] >= len(PROMPTS[0])  # prompt 0, stored by A before

    restarted = Child(tiny_model, share, tmp_path / "a2.log")
    children.append(restarted)
    again = restarted.ask(prompts=[PROMPTS[0]])
    assert again["tokens"] == expected[:1]
    assert again["host_hit_tokens"] == len(PROMPTS[0]), again  # warm at its first request
    assert b.close() == 0 and restarted.close() == 0
    left = counts(share)
    assert left is not None and left.pinned == 0 and left.storing == 0
