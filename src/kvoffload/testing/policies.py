"""Completion policies for the manual worker: scripted, recorded and replayable.

At each step the worker asks which runnable jobs to report. Jobs runnable for
``max_hold`` steps or more are reported (successfully) regardless, so every job
completes eventually, as a real worker's would. The other, *holdable* jobs follow a
decision: a :class:`Choice`, or a string of per-job codes over the holdable jobs in
job-id order (``C`` complete, ``F`` fail, ``H`` hold). A consultation with at least
one holdable job is a *branch point*; the policy records the decision it applied at
each, as codes, so any run can be replayed and shrunk.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Callable, Sequence

from kvoffload.engine.manual_worker import PendingJob


class Choice(enum.Enum):
    ALL = "all"  # report every holdable job
    NONE = "none"  # hold them all
    OLDEST = "oldest"  # report the oldest only
    FAIL_OLDEST = "fail_oldest"  # fail the oldest, hold the rest


Decision = Choice | str
Chooser = Callable[[int, Sequence[PendingJob]], str]


def _codes(choice: Choice, n: int) -> str:
    if choice is Choice.ALL:
        return "C" * n
    if choice is Choice.NONE:
        return "H" * n
    first = "C" if choice is Choice.OLDEST else "F"
    return first + "H" * (n - 1)


class DecisionPolicy:
    """Replays ``decisions`` at successive branch points; past them, ``chooser``
    decides (default: complete everything)."""

    def __init__(
        self,
        decisions: Sequence[Decision] = (),
        *,
        max_hold: int = 3,
        chooser: Chooser | None = None,
    ) -> None:
        self.decisions = list(decisions)
        self.max_hold = max_hold
        self.chooser = chooser
        self.record: list[str] = []
        self.branch_steps: list[int] = []

    @property
    def branch_points(self) -> int:
        return len(self.record)

    def __call__(self, step: int, jobs: Sequence[PendingJob]) -> dict[int, bool]:
        ordered = sorted(jobs, key=lambda p: p.job.job_id)
        forced = [p for p in ordered if step - p.planned_step >= self.max_hold]
        holdable = [p for p in ordered if step - p.planned_step < self.max_hold]
        out = {p.job.job_id: True for p in forced}
        if not holdable:
            return out
        index = len(self.record)
        if index < len(self.decisions):
            decision = self.decisions[index]
            codes = _codes(decision, len(holdable)) if isinstance(decision, Choice) else decision
        elif self.chooser is not None:
            codes = self.chooser(step, holdable)
        else:
            codes = ""
        codes = (codes + "C" * len(holdable))[: len(holdable)]
        self.record.append(codes)
        self.branch_steps.append(step)
        for pending, code in zip(holdable, codes, strict=True):
            if code != "H":
                out[pending.job.job_id] = code == "C"
        return out


def random_chooser(rng: random.Random) -> Chooser:
    """Per-job random decisions with per-run rates: holds, reorderings, failures."""
    p_hold = rng.choice((0.0, 0.3, 0.6, 0.85))
    p_fail = rng.choice((0.0, 0.0, 0.05, 0.2))

    def choose(step: int, jobs: Sequence[PendingJob]) -> str:
        codes = []
        for _ in jobs:
            r = rng.random()
            codes.append("H" if r < p_hold else "F" if r < p_hold + p_fail else "C")
        return "".join(codes)

    return choose
