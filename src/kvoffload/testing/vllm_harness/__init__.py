"""A step-by-step harness over vLLM's real scheduler with kvoffload's real connectors
(``harness.py``: the engine loop; ``ranks.py``: each worker's share of a step;
``model_runner.py`` and ``kv_model.py``: the fake model; ``checks.py``: what is
checked; ``gates.py``, ``completions.py``: when transfers finish; ``fleet.py``: several engines
over one node-shared host tier, killed at will); the vLLM fuzzer
(``kvoffload.testing.vllm_fuzz``) drives it."""

from kvoffload.testing.vllm_harness.checks import HarnessViolation
from kvoffload.testing.vllm_harness.completions import CompleteAll, Completions
from kvoffload.testing.vllm_harness.gates import CopyGate, GatedTiers, TornWrites
from kvoffload.testing.vllm_harness.harness import VllmHarness
from kvoffload.testing.vllm_harness.records import StepRecord
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
