"""kvoffload: KV-cache offloading for LLM serving engines.

The engine-agnostic core lives in :mod:`kvoffload.core` (no torch, no vllm); the
worker half (tensors and copies) in :mod:`kvoffload.transfer`; storage tiers in
:mod:`kvoffload.tiers`; the vLLM connector in :mod:`kvoffload.vllm`.
"""

__version__ = "0.1.0"
