"""The simulation's requests and what each engine step computes.

- :class:`SimRequest` is the reference engine's request whose block hashes come from
  its :class:`~kvoffload.simulate.content.Content` instead of token ids (the prompt
  is a placeholder of the right length).
- :class:`StepMeter` counts what the current engine step computes, for the cost model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvoffload.engine.request import Request
from kvoffload.simulate.content import ContentHasher
from kvoffload.simulate.trace import TraceRequest


class SimRequest(Request):
    """A request of the simulation (see the module docstring); mutated by its engine
    (progress) and by the simulation driver (the timing fields)."""

    def __init__(
        self, request_id: str, spec: TraceRequest, index: int, hasher: ContentHasher
    ) -> None:
        prompt_tokens = spec.prompt_tokens
        super().__init__(request_id, (), spec.output, hasher.block_size, spec.salt)
        self.prompt = [0] * prompt_tokens  # placeholder ids: only the length is read
        self.content = hasher.content(spec, index)
        self.hasher = hasher
        self._hashes = hasher.initial(self.content)[: prompt_tokens // hasher.block_size]
        self.arrival = spec.t
        self.index = index  # its position in the workload (arrival order)
        self.first_token_at: float | None = None
        self.computed_high = 0  # positions whose KV was ever computed (decode accounting)
        self.admissions = 0
        self.first_local = 0  # tokens from the engine's prefix cache at the first admission
        self.first_external = 0  # tokens loaded from kvoffload at the first admission
        self.cached_list: list[int] | None = None  # block list cached_upto refers to
        self.cached_upto = 0  # leading blocks registered in the prefix cache

    @property
    def block_hashes(self) -> list[bytes]:
        full = self.num_tokens // self.block_size
        if len(self._hashes) < full:
            self.hasher.extend(self.content, self._hashes, full)
        return self._hashes


@dataclass
class StepMeter:
    """What the current engine step computes; reset by the driver every step."""

    prefill: int = 0  # positions computed that are not fresh output (incl. recompute)
    decode: int = 0  # output positions whose KV is computed for the first time
    first_tokens: list[SimRequest] = field(default_factory=list)
    finished: list[SimRequest] = field(default_factory=list)
    scheduled: int = 0  # requests scheduled this step

    def reset(self) -> None:
        self.prefill = self.decode = self.scheduled = 0
        self.first_tokens.clear()
        self.finished.clear()
