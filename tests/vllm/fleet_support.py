"""Test support for harness fleets (several engines over one node-shared host tier,
``kvoffload.testing.vllm_harness.fleet``)."""

from __future__ import annotations

from kvoffload.testing.vllm_harness import VllmHarness
from kvoffload.testing.vllm_harness.fleet import SharedFleet


def serve(fleet: SharedFleet, engine: int, request_id: str, prompt: list[int]) -> VllmHarness:
    """Run one request on ``engine`` to its end (3 tokens); its output is checked
    against its reference."""
    h = fleet.engine(engine)
    h.add_request(request_id, prompt, 3)
    while h.busy():
        fleet.step(engine)
    assert h.output_tokens(request_id) == h.model.reference_output(request_id, prompt, 3)
    return h
