"""N engine replicas over host memory: one shared host tier, or a private one each.

Each replica is a whole simulated engine (:class:`~kvoffload.simulate.runner`'s
wiring): its own engine prefix cache and KV blocks, batching, clock, scheduler half
and worker lanes into its own GPU. What they share: the workload's content hashes
(the same tokens hash alike in every engine) and, with ``shared``, the host
directory (:class:`~kvoffload.simulate.host_ledger.SharedHost` of ``cpu_bytes``: one
index, one eviction policy, chunks any replica can hit). Without it each replica
has a host directory of ``cpu_bytes // N``: the same memory in all. Lower tiers are
not modelled with several replicas (refused by :func:`run_replicas`).

Time: one event queue over the replicas' steps, in simulated time. A step is two
events: its *start* (admissions, lookups, the plan, the forward pass costed: the
reference engine's schedule-and-run) at the replica's clock, and its *apply* (the
sampled tokens and the worker's reports, given to the scheduler half) at the step's
end. So a chunk one replica stores becomes readable to the others when its store is
reported complete (the end of the first step of the storing replica that ends after
the copy did), and not before; at equal times applies come first, then starts, in
the order they were queued. A replica with work but nothing to compute or complete
waits for its next arrival or job completion and, sharing the tier, for the next
event of any other replica (a store it waits for may complete there). With one
replica the events are exactly :func:`~kvoffload.simulate.runner.run_simulation`'s
loop, step for step.

Requests go to replicas as :class:`~kvoffload.simulate.routing.Router` says, in
arrival order; ids and indexes are the workload's, as in a run of one engine.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace

from kvoffload.core.errors import UsageError
from kvoffload.engine.engine import StepBatch
from kvoffload.simulate.content import ContentHasher
from kvoffload.simulate.host_ledger import HostLedger, SharedHost
from kvoffload.simulate.replica_report import ReplicasResult, merge_results
from kvoffload.simulate.request import SimRequest
from kvoffload.simulate.routing import ReplicaSetup, Router
from kvoffload.simulate.runner import STUCK_STEPS, Simulation
from kvoffload.simulate.settings import SimConfig
from kvoffload.simulate.trace import TraceRequest

__all__ = ["ReplicaSetup", "run_replicas"]

_APPLY, _START = 0, 1  # at equal times, applies first


@dataclass
class _Replica:
    """One replica's engine and its place in the run: requests routed to it that
    have not arrived yet, arrived ones waiting for its queue, its step in flight."""

    sim: Simulation
    future: deque[tuple[int, TraceRequest]] = field(default_factory=deque)
    backlog: deque[SimRequest] = field(default_factory=deque)
    batch: StepBatch | None = None
    stuck: int = 0


class _Replicas:
    """The replicas of one run and the event queue driving them (module docstring)."""

    def __init__(self, config: SimConfig, setup: ReplicaSetup) -> None:
        self.config = config
        self.setup = setup
        n = setup.replicas
        hasher = ContentHasher(config.block_size)
        self.shared: SharedHost | None = None
        each = config
        if setup.shared and config.host_slots:
            self.shared = SharedHost(
                config.host_slots,
                n,
                policy=config.eviction,
                store_threshold=config.store_threshold,
            )
        elif not setup.shared:
            each = replace(config, cpu_bytes=config.cpu_bytes // n)
        self.reps = [_Replica(Simulation(each, self.shared, hasher)) for _ in range(n)]
        hosts = [r.sim.host for r in self.reps if r.sim.host is not None]
        self.ledger = HostLedger([self.shared] if self.shared is not None else hosts)
        self.router = Router(setup)
        self._events: list[tuple[float, int, int, int]] = []  # (time, phase, order, replica)
        self._order = itertools.count()
        self._source: Iterator[TraceRequest] = iter(())
        self._index = 0

    # ------------------------------------------------------------ arrivals

    def _next_arrival(self, i: int) -> float | None:
        """When the next request routed to replica ``i`` arrives (None: no more);
        routes requests from the workload until it knows."""
        future = self.reps[i].future
        while not future:
            spec = next(self._source, None)
            if spec is None:
                return None
            self.reps[self.router.assign(spec, self._index)].future.append((self._index, spec))
            self._index += 1
        return future[0][1].t

    def _push(self, at: float, phase: int, i: int) -> None:
        heapq.heappush(self._events, (at, phase, next(self._order), i))

    # ------------------------------------------------------------ events

    def _start(self, i: int) -> None:
        """Replica ``i``'s next step starts at its clock (or it waits for an arrival)."""
        rep = self.reps[i]
        sim = rep.sim
        clock, engine = sim.clock, sim.engine
        arrival = self._next_arrival(i)
        while arrival is not None and arrival <= clock.now:
            index, spec = rep.future.popleft()
            rep.backlog.append(sim._make(spec, index))
            arrival = self._next_arrival(i)
        while rep.backlog and len(engine.waiting) < self.config.max_queue:
            engine.add(rep.backlog.popleft())
        if not (engine.waiting or engine.running or rep.backlog) and engine.idle:
            if arrival is not None:  # else this replica is done
                clock.now = max(clock.now, arrival)
                self._push(clock.now, _START, i)
            return
        sim.meter.reset()
        rep.batch = engine.run_step()
        if sim.worker is None:
            clock.end_step(sim.meter, self.config.cost)
        self._push(clock.step_end, _APPLY, i)

    def _apply(self, i: int, progress: Callable[[int], None] | None) -> None:
        """Replica ``i``'s step ends: its output and reports are applied."""
        rep = self.reps[i]
        sim = rep.sim
        clock, worker = sim.clock, sim.worker
        assert rep.batch is not None
        batch, rep.batch = rep.batch, None
        sim.engine.apply_step(batch)
        clock.now = clock.step_end
        sim._account(progress)
        if sim.meter.scheduled or (worker is not None and worker.completed_last_step):
            rep.stuck = 0
            self._push(clock.now, _START, i)
            return
        events = [self._next_arrival(i), worker.next_finish() if worker is not None else None]
        if self.shared is not None:  # a store it waits for may complete in another replica
            events += [at for at, _, _, _ in self._events]
        later = [t for t in events if t is not None and t > clock.now]
        if later:
            clock.now = min(later)
        rep.stuck += 1
        if rep.stuck > STUCK_STEPS:
            raise RuntimeError(
                f"simulation stuck at t={clock.now:.3f}s in replica {i}: {sim._state()}"
            )
        self._push(clock.now, _START, i)

    def run(
        self, requests: Iterable[TraceRequest], progress: Callable[[int], None] | None
    ) -> ReplicasResult:
        started = time.perf_counter()
        self._source = iter(requests)
        for i in range(len(self.reps)):
            self._push(0.0, _START, i)
        shared, ledger = self.shared, self.ledger
        while self._events:
            _, phase, _, i = heapq.heappop(self._events)
            if shared is not None:
                shared.current = i
            if phase == _START:
                self._start(i)
            else:
                self._apply(i, progress)
            ledger.observe()
        for rep in self.reps:
            rep.sim._finish()
        result = merge_results(
            self.config,
            self.setup,
            [rep.sim for rep in self.reps],
            self.shared,
            self.ledger,
        )
        result.total.wall_s = time.perf_counter() - started
        return result


def run_replicas(
    config: SimConfig,
    setup: ReplicaSetup,
    requests: Iterable[TraceRequest],
    progress: Callable[[int], None] | None = None,
) -> ReplicasResult:
    """Simulate ``requests`` (in timestamp order) on ``setup.replicas`` engines of
    ``config`` (module docstring). UsageError with a lower tier (not modelled with
    several replicas) or for a request larger than an engine's KV capacity."""
    if config.has_lower_tier:
        raise UsageError(
            "--replicas: lower tiers are not modelled with several replicas "
            "(host memory only: drop --<tier>-bytes)"
        )
    return _Replicas(config, setup).run(requests, progress)
