"""Settings of the reference engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class StepMode(enum.Enum):
    SYNC = "sync"  # apply each step's output before scheduling the next
    BATCH_QUEUE = "batch_queue"  # schedule and run step N+1 before applying N's output


@dataclass(frozen=True)
class EngineConfig:
    num_blocks: int
    block_size: int
    token_budget: int = 64
    max_running: int = 8
    vocab: int = 1000
    mode: StepMode = StepMode.SYNC
    enable_prefix_caching: bool = True
