"""The vLLM these tests run on is the one the run asked for.

``./scripts/test-vllm-0.33`` sets ``KVOFFLOAD_EXPECT_VLLM=0.33.0`` and runs the harness,
fuzzer, plugin, events and MultiConnector tests in its own environment (0.33's Python
over the CPU build, docs/vllm-versions.md): these checks fail there unless vLLM's
scheduler, connector API and hashing really are 0.33's. Without the variable (the main
suite, on 0.32) they are skipped.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path

import pytest

EXPECTED = os.environ.get("KVOFFLOAD_EXPECT_VLLM")

pytestmark = pytest.mark.skipif(not EXPECTED, reason="KVOFFLOAD_EXPECT_VLLM is not set")


def test_vllm_reports_the_expected_version() -> None:
    import vllm

    assert vllm.__version__ == EXPECTED


def test_the_scheduler_the_harness_drives_is_the_expected_vllm_s_own() -> None:
    from vllm.v1.core.sched import async_scheduler, scheduler

    import vllm
    from kvoffload.testing.vllm_harness import harness

    package = Path(vllm.__file__).parent
    assert harness.Scheduler is scheduler.Scheduler
    assert harness.AsyncScheduler is async_scheduler.AsyncScheduler
    for module in (scheduler, async_scheduler):
        assert Path(str(module.__file__)).is_relative_to(package)


@pytest.mark.skipif(EXPECTED != "0.33.0", reason="checks what 0.33 added")
def test_what_0_33_added_is_there() -> None:
    from vllm.distributed.kv_events import BlockStored
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher

    assert hasattr(KVConnectorBase_V1, "supports_sleep_mode")
    assert hasattr(KVConnectorBase_V1, "get_external_cache_hit_sources")
    assert "num_hash_lookahead_tokens" in inspect.signature(get_request_block_hasher).parameters
    assert "lookahead_token_ids" in BlockStored.__struct_fields__
