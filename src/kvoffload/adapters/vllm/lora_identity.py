"""LoRA adapters identified by the content vLLM loaded, in a request's keys
(decisions 0019 and 0025).

vLLM's block hashes name a request's LoRA adapter by its name and path only. kvoffload
adds the adapter's content digest to the seed of the request's key chain
(:attr:`RequestTable.key_extra <kvoffload.core.scheduler.requests.RequestTable>`):
every file of a local adapter directory (or the adapter file itself), each read in
full and remembered until it changes (:mod:`kvoffload.core.identity.content_digest`).
An adapter that is not a local path (a hub id vLLM resolves itself) is named by its
name and path, as vLLM names it (:class:`AdapterDigests`).

What computes a request is the adapter vLLM's worker holds under the request's
``lora_int_id``, not the files: vLLM loads an adapter when a request that names it
first runs (or on ``add_lora``) and keeps it in an LRU cache; it reads the files again
only when it loads the id anew (after an eviction, ``remove_lora`` and a new add, a
``load_inplace`` request, a weight reload). Files rewritten while the id stays loaded
are not what computes. So (:class:`LoraPins`, the scheduler half):

- **A pin per ``lora_int_id``.** The first time the scheduler half meets an id (a
  request naming it, or a worker's report of a load it did on its own, ``add_lora``)
  it takes the digest: of the files then, or the one the worker reported. Every
  request of that id is keyed with the pin, whatever happens to the files afterwards;
  the files are never read again for it.
- **The workers report every load** (``worker_loras.py``): the digest of the files
  vLLM read, taken around the load (a load during which a file changed gets a digest
  that matches nothing). A load whose digest is the pin's changes nothing (an eviction
  and a reload of the same files).
- **A load of other contents under a pinned id** (the files were rewritten, then vLLM
  loaded the id anew) *changes* the id: its requests are served without offloading
  from then on, until the engine restarts (requests of that id already live included:
  ``OFF`` controls, neither stored nor loaded; new ones: ``key_extra`` answers None).
  vLLM's own prefix cache still holds blocks computed with the earlier contents under
  the same name and path, which kvoffload would otherwise store under the new
  contents' identity; a changed adapter is served fully offloaded again when loaded
  under a new ``lora_int_id`` (vLLM's serving warns alike: load changed weights from a
  new path). Counted (``anomalies_total{kind="lora_changed"}``) and logged once per id.
- **Every plan names, for each request with a load or store in it that has an
  adapter, the id and the digest its keys carry** (:class:`LoraStamp`); a worker
  refuses the request's jobs unless that is the digest of what it holds under the id
  (``worker_loras.py``: the fence). So a chunk is only ever stored under the digest of
  the adapter that computed it, even in the steps before a report arrives.

Owned by the scheduler half; called on its thread, under its lock. Never raises.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvoffload.core.identity import content_digest
from kvoffload.core.identity import model as model_identity
from kvoffload.core.jobs import StepPlan
from kvoffload.core.observe.anomalies import Anomaly, AnomalyLog
from kvoffload.core.request_controls import OFF

logger = logging.getLogger("kvoffload")


class AdapterDigests:
    """The content digest of a LoRA adapter's files (module docstring)."""

    def __init__(self, cache: content_digest.DigestCache | None = None) -> None:
        self._cache = cache

    def digest(self, name: str, path: str) -> str:
        """The adapter at ``path``'s content digest (its name and path when it is not
        a local path)."""
        files = _files(path)
        if isinstance(files, str):
            return model_identity.digest_of(["lora", files, name, path])
        digests = content_digest.digest_files(files, self._cache)
        return model_identity.digest_of(
            ["lora", [[f.name, d] for f, d in zip(files, digests, strict=True)]]
        )

    @staticmethod
    def signatures(path: str) -> list[object]:
        """What must stay the same while vLLM reads the adapter for :meth:`digest` to
        name the bytes it read: each file's stat signature (``content_digest``)."""
        files = _files(path)
        if isinstance(files, str):
            return [files]
        out: list[object] = []
        for f in files:
            try:
                out.append([f.name, content_digest.signature(os.stat(f))])
            except OSError as exc:
                out.append([f.name, type(exc).__name__])
        return out


def _files(path: str) -> list[Path] | str:
    """The adapter's files, sorted, or why there are none to read (not a local path,
    a directory that cannot be listed)."""
    root = Path(path)
    try:
        if root.is_dir():
            with os.scandir(root) as entries:
                return sorted(Path(e.path) for e in entries if e.is_file())
        if root.is_file():
            return [root]
    except OSError as exc:
        return f"unlistable {type(exc).__name__}"
    return "by name"


@dataclass(frozen=True)
class LoraJob:
    """A request with a load or store in a plan: its adapter's id, the digest its keys
    carry, and the adapter's name and path (for a worker that has not loaded it yet)."""

    request_id: str
    lora_id: int
    digest: str
    name: str
    path: str


@dataclass(frozen=True)
class LoraStamp:
    """What a plan's loads and stores of requests with an adapter were keyed with."""

    jobs: tuple[LoraJob, ...]


def lora_of(request: Any) -> tuple[int, str, str] | None:
    """A request's adapter as (``lora_int_id``, name, path); None without one."""
    lora = getattr(request, "lora_request", None)
    if lora is None:
        return None
    name = str(getattr(lora, "lora_name", "") or "")
    return int(getattr(lora, "lora_int_id", 0) or 0), name, str(getattr(lora, "lora_path", ""))


class LoraPins:
    """The digest each ``lora_int_id`` is pinned to (see the module docstring).

    ``states`` lists the scheduler half's live request states (each with ``request``
    and a mutable ``controls``); ``state_of`` finds one by request id; ``anomalies``
    counts changed adapters. Owns the pins and the set of changed ids."""

    def __init__(
        self,
        states: Callable[[], Iterable[Any]],
        state_of: Callable[[str], Any],
        anomalies: AnomalyLog,
        digests: AdapterDigests | None = None,
    ) -> None:
        self._states = states
        self._state_of = state_of
        self._anomalies = anomalies
        self.digests = digests or AdapterDigests()
        self.pins: dict[int, str] = {}
        self.changed: set[int] = set()

    def extra(self, request: Any) -> bytes | None:
        """What ``request``'s adapter adds to its keys: b"" without one, its id's pin,
        or None (served without offloading) for an id whose contents changed."""
        lora = lora_of(request)
        if lora is None:
            return b""
        lora_id, name, path = lora
        if lora_id in self.changed:
            return None
        pin = self.pins.get(lora_id)
        if pin is None:
            pin = self.pins[lora_id] = self.digests.digest(name, path)
        return pin.encode()

    def learn(self, loads: Iterable[tuple[int, int, str]]) -> None:
        """The workers' loads, as ``(rank, lora_int_id, digest of what was loaded)``."""
        for rank, lora_id, digest in loads:
            pin = self.pins.setdefault(lora_id, digest)
            if pin != digest and lora_id not in self.changed:
                self._change(rank, lora_id)

    def stamp(self, plan: StepPlan) -> LoraStamp | None:
        """What the plan's loads and stores of requests with an adapter were keyed
        with (None: there are none)."""
        jobs: dict[str, LoraJob] = {}
        for job in (*plan.loads, *plan.stores):
            if job.request_id in jobs:
                continue
            state = self._state_of(job.request_id)
            lora = None if state is None else lora_of(state.request)
            if lora is not None:
                digest = state.keys.extra.decode()
                jobs[job.request_id] = LoraJob(job.request_id, lora[0], digest, *lora[1:])
        return LoraStamp(tuple(jobs.values())) if jobs else None

    def _change(self, rank: int, lora_id: int) -> None:
        self.changed.add(lora_id)
        for state in self._states():
            lora = lora_of(state.request)
            if lora is not None and lora[0] == lora_id:
                state.controls = OFF
        self._anomalies.note(
            Anomaly.LORA_CHANGED,
            f"worker rank {rank} loaded LoRA adapter id {lora_id} with other contents than "
            "its requests were keyed with (its files were rewritten, then vLLM loaded it "
            "anew): its requests are served without offloading until the engine restarts; "
            "load a changed adapter under a new lora_int_id",
        )
