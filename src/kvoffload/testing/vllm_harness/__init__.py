"""A step-by-step harness over vLLM's real scheduler with kvoffload's real connectors
(see ``harness.py``); the vLLM fuzzer (``kvoffload.testing.vllm_fuzz``) drives it."""

from kvoffload.testing.vllm_harness.gates import CopyGate, GatedTiers, TornWrites
from kvoffload.testing.vllm_harness.harness import (
    CompleteAll,
    Completions,
    HarnessViolation,
    StepRecord,
    VllmHarness,
)
from kvoffload.testing.vllm_harness.spec import HarnessSpec

__all__ = [
    "CompleteAll",
    "Completions",
    "CopyGate",
    "GatedTiers",
    "HarnessSpec",
    "HarnessViolation",
    "StepRecord",
    "TornWrites",
    "VllmHarness",
]
