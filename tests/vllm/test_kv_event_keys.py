"""kvoffload's KV events say of a request what vLLM's own block-pool events say: the
LoRA adapter's id and name, the session, and every block's extra keys (LoRA name,
multimodal items, cache salt), compared with vLLM's block pool for the same request."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from request_identities import EXTRA_KEYS
from vllm.distributed.kv_events import BlockStored
from vllm.utils.hashing import sha256
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
    maybe_convert_block_hash,
)
from vllm.v1.request import Request

from kvoffload.adapters.vllm.events import EventTranslator
from kvoffload.core.jobs import EngineJob, JobKind
from kvoffload.core.keys import ChunkKey
from kvoffload.core.observe.events import CacheEvent, EventKind
from kvoffload.tiers.registry import tier_names, tier_spec
from kvoffload.tiers.spec import Locality
from vllm import SamplingParams

BLOCK = 16
BLOCKS = 6
PER_CHUNK = 2  # hash blocks per kvoffload chunk


def request(**identity: Any) -> Request:
    init_none_hash(sha256)
    return Request(
        "r",
        [(5 * i) % 500 + 1 for i in range(BLOCKS * BLOCK)],
        SamplingParams(max_tokens=1),
        None,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
        **identity,
    )


def vllms_event(req: Request) -> BlockStored:
    """vLLM's own event for the request's full blocks, from its block pool."""
    pool = BlockPool(BLOCKS + 1, enable_caching=True, hash_block_size=BLOCK,
                     enable_kv_cache_events=True)  # fmt: skip
    pool.cache_full_blocks(req, pool.get_new_blocks(BLOCKS), 0, BLOCKS, BLOCK, 0)
    (event,) = [e for e in pool.take_events() if isinstance(e, BlockStored)]
    return event


def kvoffloads_events(
    req: Request | object, translator: EventTranslator, tier: str = "disk"
) -> list[BlockStored]:
    keys = [ChunkKey(bytes([i]) * 16) for i in range(BLOCKS // PER_CHUNK)]
    job = EngineJob(1, JobKind.STORE, "r", tuple(keys), (0, 1, 2), tuple(range(BLOCKS)), 2)
    translator.note_jobs([job], {"r": (keys, req, ChunkKey(bytes(16)))})
    events = translator.translate([CacheEvent(EventKind.STORED, tuple(keys), tier)])
    assert all(isinstance(e, BlockStored) for e in events)
    return events  # type: ignore[return-value]


IDENTITIES: dict[str, dict[str, Any]] = {"plain": {}, **EXTRA_KEYS}


@pytest.mark.parametrize("identity", IDENTITIES.values(), ids=IDENTITIES.keys())
def test_events_carry_what_vllms_block_pool_events_carry(identity: dict[str, Any]) -> None:
    req = request(**identity)
    theirs = vllms_event(req)
    ours = kvoffloads_events(req, EventTranslator(BLOCK, PER_CHUNK, maybe_convert_block_hash))
    assert [h for e in ours for h in e.block_hashes] == theirs.block_hashes
    assert theirs.extra_keys is not None
    for i, event in enumerate(ours):
        blocks = slice(i * PER_CHUNK, (i + 1) * PER_CHUNK)
        assert event.extra_keys == theirs.extra_keys[blocks]
        assert (event.lora_id, event.lora_name, event.session_id) == (
            theirs.lora_id, theirs.lora_name, theirs.session_id,
        )  # fmt: skip
    if identity:  # the fields are really filled, not equal because both are empty
        assert any(k is not None for e in ours for k in e.extra_keys or ())


def test_a_request_without_vllms_fields_is_published_without_extra_keys() -> None:
    bare = SimpleNamespace(  # no mm_features, lora_request, cache_salt: vLLM's functions fail
        block_hashes=request().block_hashes, all_token_ids=list(range(BLOCKS * BLOCK))
    )
    translator = EventTranslator(BLOCK, PER_CHUNK, maybe_convert_block_hash)
    ours = kvoffloads_events(bare, translator)
    assert [e.extra_keys for e in ours] == [[None] * PER_CHUNK] * len(ours)
    assert translator.no_extra_keys == len(ours)


@pytest.mark.parametrize("tier", tier_names())
def test_each_tier_is_labelled_by_its_spec(tier: str) -> None:
    """Medium and locality from the tier's spec; no ``ownership`` for a LOCAL tier (as
    vLLM's own CPU offloading publishes: routers credit it by medium, and Dynamo's
    indexer credits no event that carries one), the tier's name for a REMOTE one."""
    spec = tier_spec(tier)
    translator = EventTranslator(BLOCK, PER_CHUNK, maybe_convert_block_hash)
    stored = kvoffloads_events(request(), translator, tier)
    keys = tuple(ChunkKey(bytes([i]) * 16) for i in range(BLOCKS // PER_CHUNK))
    removed = translator.translate([CacheEvent(EventKind.REMOVED, keys, tier)])
    ownership = None if spec.locality is Locality.LOCAL else f"kvoffload:{tier}"
    for event in [*stored, *removed]:
        assert (event.medium, event.locality) == (spec.medium, spec.locality.value)
        assert event.ownership == ownership
    assert ownership == {"host": None, "disk": None, "redis": "kvoffload:redis"}[tier]
