"""The check's time budget, its human lines (stderr) and its one JSON line (stdout).

The JSON line has a fixed shape, whatever ran (:meth:`Report.as_json`)::

    {"ok": bool, "device": str | null, "torch": str, "cuda": str | null,
     "dry_run": bool, "correctness": [...], "throughput": [...],
     "overlap": {...} | null, "skipped": [...], "errors": [...], "wall_s": float}

``ok`` is true when no correctness case failed and no part raised. ``skipped`` names,
one string each (``"<part>: <why>"``), what did not run: the CUDA parts of a dry run,
cases cut by the time budget. ``errors`` holds one string per part or case that raised.
Nothing but the JSON line is ever written to stdout.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch

Entry = dict[str, Any]


@dataclass
class Budget:
    """Wall-clock time left until ``deadline`` (``time.monotonic()`` seconds)."""

    deadline: float

    @classmethod
    def of(cls, seconds: float) -> Budget:
        return cls(time.monotonic() + seconds)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def expired(self) -> bool:
        return self.left() <= 0

    def share(self, fraction: float, reserve: float = 0.0) -> Budget:
        """A budget for one part: ``fraction`` of the time left after ``reserve``
        seconds are kept back for the parts after it."""
        return Budget(time.monotonic() + max(0.0, (self.left() - reserve) * fraction))


@dataclass
class Report:
    """What the check found; mutated by the parts as they run (one thread)."""

    dry_run: bool
    device: str | None = None
    correctness: list[Entry] = field(default_factory=list)
    throughput: list[Entry] = field(default_factory=list)
    overlap: Entry | None = None
    codec: list[Entry] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    def say(self, line: str) -> None:
        """One human line on stderr, with the seconds since the start."""
        print(f"[gpu-check {time.monotonic() - self.started:6.1f}s] {line}", file=sys.stderr)

    def skip(self, part: str, why: str) -> None:
        self.skipped.append(f"{part}: {why}")
        self.say(f"skipped {part}: {why}")

    def error(self, part: str, exc: BaseException) -> None:
        """Record that ``part`` raised ``exc`` (its traceback goes to stderr)."""
        self.errors.append(f"{part}: {type(exc).__name__}: {exc}")
        self.say(f"ERROR in {part}: {type(exc).__name__}: {exc}")
        traceback.print_exception(exc, file=sys.stderr)

    @property
    def failed_correctness(self) -> list[Entry]:
        return [e for e in [*self.correctness, *self.codec] if not e["ok"]]

    @property
    def ok(self) -> bool:
        return not self.failed_correctness and not self.errors

    def as_json(self) -> str:
        cuda = torch.version.cuda
        return json.dumps(
            {
                "ok": self.ok,
                "device": self.device,
                "torch": str(torch.__version__),
                "cuda": str(cuda) if cuda is not None else None,
                "dry_run": self.dry_run,
                "correctness": self.correctness,
                "throughput": self.throughput,
                "overlap": self.overlap,
                "codec": self.codec,
                "skipped": self.skipped,
                "errors": self.errors,
                "wall_s": round(time.monotonic() - self.started, 3),
            }
        )

    def exit_code(self) -> int:
        """0 when everything that ran passed, 1 otherwise."""
        return 0 if self.ok else 1
