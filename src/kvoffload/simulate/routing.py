"""Several engine replicas: how many, whether they share one host tier, and which
replica serves each request.

- ``round-robin`` (the default): the ``i``-th request (by arrival) goes to replica
  ``i mod N``; a conversation's turns land on different replicas.
- ``sticky``: a request whose prompt includes an earlier request's output (its
  ``output_id`` segment: the next turn of a conversation) goes where that request
  went; any other request (a new conversation, a trace without output ids) goes to
  the next replica round-robin over such requests. What a router does without a
  shared tier: each conversation's history stays in one replica's caches.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvoffload.core.errors import UsageError
from kvoffload.simulate.trace import TraceRequest

ROUTES = ("round-robin", "sticky")


@dataclass(frozen=True)
class ReplicaSetup:
    """``replicas`` engines; ``shared``: one host tier of ``--cpu-bytes`` for all of
    them (else each its own of ``--cpu-bytes / replicas``); ``route``: one of
    :data:`ROUTES`. UsageError for a bad value."""

    replicas: int = 1
    shared: bool = False
    route: str = "round-robin"

    def __post_init__(self) -> None:
        if not isinstance(self.replicas, int) or self.replicas < 1:
            raise UsageError("--replicas: must be an integer >= 1")
        if self.route not in ROUTES:
            raise UsageError(f"--route: expected one of {', '.join(ROUTES)}, got {self.route!r}")

    def describe(self) -> str:
        host = "one shared host tier" if self.shared else "a private host tier each"
        return f"{self.replicas} replicas, {host}, {self.route} routing"


class Router:
    """Assigns requests, in arrival order, to replicas (module docstring). Owns the
    replica of every output id not yet continued (sticky)."""

    def __init__(self, setup: ReplicaSetup) -> None:
        self.replicas = setup.replicas
        self.sticky = setup.route == "sticky"
        self._of_output: dict[str, int] = {}
        self._new = 0  # requests routed round-robin so far (sticky)

    def assign(self, spec: TraceRequest, index: int) -> int:
        """The replica of ``spec``, the ``index``-th request of the workload."""
        if not self.sticky:
            return index % self.replicas
        replica = None
        for segment, _ in reversed(spec.segments):
            replica = self._of_output.pop(segment, None)
            if replica is not None:
                break
        if replica is None:
            replica = self._new % self.replicas
            self._new += 1
        if spec.output_id is not None:
            self._of_output[spec.output_id] = replica
        return replica
