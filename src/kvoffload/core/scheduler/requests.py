"""The request table: the one owner of the scheduler half's request states.

A state is created at a request's first lookup or allocation (with the controls its
``kv_transfer_params`` carry; a refused value is counted and warned about) and
dropped when the request is done: finished, its final store planned, nothing in
flight. The jobs a request waits for are not kept here: the job tracker
(:attr:`RequestTable.tracker`) is their one owner and answers, by request id, what a
request has in flight.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from kvoffload.core.identity.weights import WeightsState
from kvoffload.core.keys import Namespace
from kvoffload.core.observe.anomalies import ParamErrorLog
from kvoffload.core.observe.recorder import MetricsRecorder
from kvoffload.core.request_controls import OFF, parse_controls
from kvoffload.core.scheduler.job_tracker import JobTracker
from kvoffload.core.scheduler.request_state import Phase, RequestState
from kvoffload.core.scheduler_types import EngineRequest


def no_extra(request: EngineRequest) -> bytes:
    """A request adds nothing to its keys beyond vLLM's block hashes."""
    return b""


class RequestTable:
    def __init__(
        self,
        namespace: Namespace,
        hashes_per_chunk: int,
        tracker: JobTracker,
        metrics: MetricsRecorder,
        weights: WeightsState,
        *,
        groups: int = 1,
    ) -> None:
        self.namespace = namespace
        self.groups = groups  # KV cache groups: one block table each
        self.hashes_per_chunk = hashes_per_chunk
        self.tracker = tracker
        self.param_errors = ParamErrorLog(metrics)
        self.weights = weights  # read only: the key epoch new states start in
        # What a request adds to its key chain's seed (the adapter's: a LoRA adapter's
        # content digest, decisions 0019 and 0025); read once, when its state is
        # created. None: its identity cannot be named, it is served without offloading.
        self.key_extra: Callable[[EngineRequest], bytes | None] = no_extra
        self._states: dict[str, RequestState] = {}
        # The state of a request id, or None: the dict's own lookup (the hottest call
        # of the scheduler half; ``_states`` is never rebound).
        self.get: Callable[[str], RequestState | None] = self._states.get

    def new(self, request: EngineRequest) -> RequestState:
        controls, refused = parse_controls(getattr(request, "kv_transfer_params", None))
        if refused is not None:
            self.param_errors.note(request.request_id, refused)
        extra = self.key_extra(request)
        if extra is None:
            controls, extra = OFF, b""
        state = RequestState(
            request,
            self.namespace,
            self.hashes_per_chunk,
            self.weights.epoch,
            controls,
            groups=self.groups,
            extra=extra,
        )
        self._states[request.request_id] = state
        return state

    def drop(self, state: RequestState) -> None:
        """The request is done (DONE); callers drop it only once it has no job in
        flight."""
        state.move(Phase.DONE)
        del self._states[state.request_id]

    def __iter__(self) -> Iterator[RequestState]:
        return iter(list(self._states.values()))

    def __len__(self) -> int:
        return len(self._states)

    def ids(self) -> list[str]:
        return list(self._states)

    def as_dict(self) -> dict[str, RequestState]:
        """A read-only view for the invariant checks (do not mutate)."""
        return self._states
