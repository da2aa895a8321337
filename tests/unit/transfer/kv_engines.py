"""Small fake engine KV caches in every supported layout, and a reference model.

The reference model (:func:`record`) defines a block record straight from the
layout rule (pages of every view before the block dimension, in order), without any
code from kvoffload.transfer, so the tests compare the worker against the rule.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from kvoffload.core.jobs import EngineJob, JobKind
from kvoffload.core.keys import ChunkKey

Caches = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Engine:
    """KV caches plus, per layer, the index of its block dimension."""

    caches: Caches
    block_dims: dict[str, int]
    num_blocks: int


def vllm_cpu(num_blocks: int, layers: int = 3, dtype: torch.dtype = torch.bfloat16) -> Engine:
    """Per layer [N, heads, block, 2*head], all layers views of one shared storage."""
    shape = (num_blocks, 2, 4, 16)
    per_layer = num_blocks * 2 * 4 * 16
    raw = torch.empty(layers * per_layer, dtype=dtype)
    caches = {
        f"model.layers.{i}.attn": raw[i * per_layer : (i + 1) * per_layer].view(shape)
        for i in range(layers)
    }
    return _randomized(caches, 0, num_blocks)


def gpu_style(num_blocks: int, layers: int = 3, dtype: torch.dtype = torch.float16) -> Engine:
    """Per layer [2, N, block, heads, dim], separately allocated (K and V pages)."""
    caches = {f"layer{i}": torch.empty(2, num_blocks, 4, 2, 8, dtype=dtype) for i in range(layers)}
    return _randomized(caches, 1, num_blocks)


def cross_layer(num_blocks: int, layers: int = 3) -> Engine:
    """One tensor [N, layers, 2, block, heads, dim]."""
    caches = {"all": torch.empty(num_blocks, layers, 2, 4, 2, 8, dtype=torch.bfloat16)}
    return _randomized(caches, 0, num_blocks)


def odd_pages(num_blocks: int) -> Engine:
    """6-byte pages (int16 words) of two different sizes: two page groups."""
    caches = {
        "a": torch.empty(num_blocks, 3, dtype=torch.float16),
        "b": torch.empty(num_blocks, 5, dtype=torch.float16),
    }
    return _randomized(caches, 0, num_blocks)


ENGINES: dict[str, Callable[[int], Engine]] = {
    "vllm_cpu": vllm_cpu,
    "gpu_style": gpu_style,
    "cross_layer": cross_layer,
    "odd_pages": odd_pages,
}


def _randomized(caches: Caches, block_dim: int, num_blocks: int) -> Engine:
    gen = torch.Generator().manual_seed(len(caches) * 1000 + num_blocks)
    for t in caches.values():
        raw = t.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
    return Engine(caches, {name: block_dim for name in caches}, num_blocks)


def record(engine: Engine, block: int) -> bytes:
    """The reference bytes of one block record: every page view's page, in order."""
    out = []
    for name, t in engine.caches.items():
        bdim = engine.block_dims[name]
        for index in itertools.product(*(range(s) for s in t.shape[:bdim])):
            page = t[index][block] if index else t[block]
            out.append(page.contiguous().view(torch.uint8).flatten().numpy().tobytes())
    return b"".join(out)


def snapshot(engine: Engine) -> dict[str, torch.Tensor]:
    return {name: t.view(torch.uint8).clone() for name, t in engine.caches.items()}


def job(
    job_id: int,
    kind: JobKind,
    slots: Iterable[int],
    blocks: Iterable[int],
    k: int,
    *,
    skip: int = 0,
) -> EngineJob:
    slot_ids = tuple(slots)
    keys = tuple(ChunkKey(i.to_bytes(16, "little")) for i in range(len(slot_ids)))
    return EngineJob(job_id, kind, f"req{job_id}", keys, slot_ids, tuple(blocks), k, skip)


class Gate:
    """A copy hook that holds chosen jobs until released and fails chosen jobs.

    ``started[job_id]`` is set when the copy thread reaches the job; a held job then
    blocks until ``release(job_id)``. Waits have a generous timeout only so that a
    broken test fails instead of hanging; no test relies on timing.
    """

    TIMEOUT = 30.0

    def __init__(self, hold: Iterable[int] = (), fail: Iterable[int] = ()) -> None:
        self._hold = {i: threading.Event() for i in hold}
        self._fail = set(fail)
        self.started = {i: threading.Event() for i in self._hold}
        self.seen: list[int] = []

    def __call__(self, job: EngineJob) -> None:
        self.seen.append(job.job_id)
        if job.job_id in self._hold:
            self.started[job.job_id].set()
            assert self._hold[job.job_id].wait(self.TIMEOUT), "held job never released"
        if job.job_id in self._fail:
            raise RuntimeError(f"injected failure in job {job.job_id}")

    def wait_started(self, job_id: int) -> None:
        assert self.started[job_id].wait(self.TIMEOUT), f"job {job_id} never started"

    def release(self, job_id: int) -> None:
        self._hold[job_id].set()
