"""Requests with every kind of extra key vLLM hashes into block hashes (a LoRA
adapter, a cache salt, a session, multimodal features across chunks), as keyword
arguments of the tests' request builders (``test_kv_event_keys.py``,
``test_share_announcer.py``)."""

from __future__ import annotations

from typing import Any

from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

EXTRA_KEYS: dict[str, dict[str, Any]] = {
    "lora, salt, session": {
        "lora_request": LoRARequest("adapter-a", 7, "/adapters/a"),
        "cache_salt": "tenant-x",
        "session_id": "s-1",
    },
    "multimodal across chunks": {
        "mm_features": [
            MultiModalFeatureSpec(None, "image", "img-1", PlaceholderRange(offset=20, length=30)),
            MultiModalFeatureSpec(None, "image", "img-2", PlaceholderRange(offset=70, length=4)),
        ],
        "cache_salt": "tenant-y",
    },
}
