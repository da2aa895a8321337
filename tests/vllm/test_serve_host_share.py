"""Two ``vllm serve`` processes on one node-shared host tier, as a user runs them:
the README's kind of command with ``host_share`` set, requests through the
``openai`` client, kvoffload's series read from each server's ``/metrics``.

Server A answers a long prompt (its chunks stored in the share); server B, another
process with its own engine, then gets the same prompt as its first request: it is
served from host memory (B's own kvoffload host hit tokens and loaded chunks), with
A's text. The share's slab holds one ``cpu_bytes``. Both servers and the share's node
process are stopped by pid at the end, on failure too. Wall times are never asserted.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from share_support import share_config, stop_node_process
from test_serve import (
    HIT_TOKENS,
    KV_CACHE_BYTES,
    LOADED,
    STORED,
    complete,
    eventually,
    metrics,
    prompt,
    served_model,
    transfer_config,
)

from kvoffload.share.paths import SharePaths
from kvoffload.share.slab_files import HEADER_BYTES
from kvoffload.testing.vllm_server import VllmServer

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

__all__ = ["served_model"]  # the fixture, imported for this module's tests

SHARE_BYTES = 64_000_000


def test_server_b_is_served_from_what_server_a_stored(served_model: Path, tmp_path: Path) -> None:
    extra = share_config(tmp_path / "shm", f"serve-{os.getpid()}", SHARE_BYTES)
    args = ["--kv-transfer-config", transfer_config(extra), "--enable-prompt-tokens-details"]
    text = prompt(0, 768) + " " + prompt(900, 12)
    a = VllmServer(served_model, tmp_path / "a.log", args, kv_cache_bytes=KV_CACHE_BYTES)
    b = VllmServer(served_model, tmp_path / "b.log", args, kv_cache_bytes=KV_CACHE_BYTES, cores="1")
    try:
        with a:
            client_a: Any = openai.OpenAI(base_url=a.base_url, api_key="-", max_retries=0)
            first = complete(client_a, a.model, text)
            stored = eventually(a, lambda m: m.get(STORED, 0) >= 24)
            assert stored.get(STORED, 0) >= 24, "server A stored less than its prompt's chunks"
            with b:
                client_b: Any = openai.OpenAI(base_url=b.base_url, api_key="-", max_retries=0)
                before = metrics(b)
                assert before.get(HIT_TOKENS, 0) == 0 and before.get(LOADED, 0) == 0
                again = complete(client_b, b.model, text)
                after = eventually(b, lambda m: m.get(LOADED, 0) > 0)

                assert again.choices[0].text == first.choices[0].text
                assert again.usage.prompt_tokens_details.cached_tokens >= 768
                assert after.get(HIT_TOKENS, 0) >= 768, "B's first request was not a host hit"
                assert after.get(LOADED, 0) >= 24
                assert "host share" in b.log_text() and "found running" in b.log_text()
        share_dir = SharePaths(extra["host_share"], tmp_path / "shm").dir
        slabs = [p for p in share_dir.iterdir() if p.name.startswith("slab.")]
        assert len(slabs) == 1  # one share for both servers (one rank each)
        assert slabs[0].stat().st_size - HEADER_BYTES <= SHARE_BYTES
    finally:
        a.stop()
        b.stop()
        stop_node_process(extra)
