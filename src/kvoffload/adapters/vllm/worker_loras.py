"""One worker's side of the LoRA adapters' identity (decision 0025): what it loaded,
reported to the scheduler half, and the fence on the plans' loads and stores.

- :meth:`WorkerLoras.open` (at ``register_kv_caches``): find vLLM's worker LoRA
  manager on the model runner (``lora_manager``: vLLM's ``LRUCacheWorkerLoRAManager``,
  none when LoRA is off) and route its ``_load_adapter`` through :meth:`_loaded`, on
  the instance. vLLM calls it for every load of an adapter from its files: the first
  time a request of an id runs, after an eviction from its LRU cache, for a
  ``load_inplace`` request or ``add_lora``. Around each load the adapter's files are
  stat'ed (before and after) and digested (``lora_identity.AdapterDigests``, with the
  digest cache the scheduler half filled: usually no byte is read again); a load
  during which a file changed is given a digest that matches nothing.
- :meth:`WorkerLoras.refused` (before jobs of a plan run, at each of vLLM's calls of
  a step): the requests of the plan's :class:`~.lora_identity.LoraStamp` whose loads
  and stores must not run: those whose keys' digest is not the one of the adapter
  this worker holds under their id, or whose id this worker loaded with two different
  contents (a chunk computed partly with each must never be stored under either), or
  every one when the LoRA manager was not found. An id vLLM does not hold now (not
  loaded yet: a request's first hit after a restart; or evicted from vLLM's LRU cache
  since: ``list_adapters``) is loaded from its files when the request runs, a step
  later: a load for it runs only when the adapter's files now give the digest (a
  rewrite in that one step is reported with vLLM's load and changes the id: nothing is
  stored for it from then on, as the scheduler half says). A store for it is refused.
  Refused jobs fail with the weights fence's error (``FENCED``): a load is recomputed,
  a store never made readable, both counted in ``kvoffload_fenced_jobs_total``.
- :meth:`WorkerLoras.take_reports`: the loads since the last report, as ``(rank,
  lora_int_id, digest)``, for the scheduler half (``ReportMetadata.loras``).

vLLM loads adapters in ``_prepare_inputs``, before the forward pass and after
``handle_preemptions``: the state :meth:`refused` reads when the step's loads and
stores are submitted is the adapter that computes (stores) or will compute (loads)
them. Owned by one worker half; the wrapped ``_load_adapter`` runs in whichever
thread vLLM loads from (its worker loop), under a lock.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable
from typing import Any

from kvoffload.adapters.vllm.lora_identity import AdapterDigests, LoraStamp
from kvoffload.core.jobs import StepPlan

logger = logging.getLogger("kvoffload")

_UNMATCHED = itertools.count()


class WorkerLoras:
    """One worker's loaded adapters (see the module docstring)."""

    def __init__(self, digests: AdapterDigests | None = None) -> None:
        self.digests = digests or AdapterDigests()
        self.rank = 0
        self.manager: Any = None  # vLLM's worker LoRA manager, once found
        self._guard = threading.Lock()
        self._held: dict[int, str] = {}  # lora_int_id -> digest of its latest load
        self._changed: set[int] = set()  # ids loaded with two different contents
        self._reports: list[tuple[int, int, str]] = []  # not yet sent
        self._warned = False

    def open(self, rank: int, runner: Any) -> None:
        """Wrap the LoRA manager of ``runner`` (vLLM's model runner; None: not found)."""
        self.rank = rank
        manager = getattr(runner, "lora_manager", None)
        original = getattr(manager, "_load_adapter", None)
        if manager is None or not callable(original):
            return
        self.manager = manager
        manager._load_adapter = self._wrap(original)  # on the instance only

    def _wrap(self, original: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def load_adapter(lora_request: Any) -> Any:
            path = str(getattr(lora_request, "lora_path", ""))
            before = self.digests.signatures(path)
            loaded = original(lora_request)
            self._loaded(lora_request, before)
            return loaded

        return load_adapter

    def _loaded(self, lora_request: Any, before: list[object]) -> None:
        """vLLM loaded ``lora_request``'s adapter; its files' signatures were
        ``before`` when it started."""
        lora_id = int(lora_request.lora_int_id)
        path = str(getattr(lora_request, "lora_path", ""))
        try:
            digest = self.digests.digest(str(getattr(lora_request, "lora_name", "")), path)
            if self.digests.signatures(path) != before:
                digest = f"changed while loaded #{next(_UNMATCHED)}"
        except Exception as exc:  # never fail vLLM's load: a digest that matches nothing
            digest = f"unidentified ({type(exc).__name__}) #{next(_UNMATCHED)}"
        with self._guard:
            earlier = self._held.get(lora_id)
            if earlier is not None and earlier != digest:
                self._changed.add(lora_id)
            self._held[lora_id] = digest
            self._reports.append((self.rank, lora_id, digest))

    def refused(self, stamp: LoraStamp | None, plan: StepPlan) -> frozenset[str]:
        """The requests of ``stamp`` (``plan``'s) whose jobs must not run now (module
        docstring)."""
        if stamp is None:
            return frozenset()
        loads = {job.request_id for job in plan.loads}
        if self.manager is None:
            self._warn()
            return frozenset(job.request_id for job in stamp.jobs)
        refused: set[str] = set()
        files: dict[tuple[str, str], str] = {}  # digests of adapters vLLM does not hold
        with self._guard:
            held, changed = dict(self._held), set(self._changed)
        listed = self._listed()
        for job in stamp.jobs:
            digest = held.get(job.lora_id) if listed is None or job.lora_id in listed else None
            if digest is None and job.request_id in loads:
                where = (job.name, job.path)
                if where not in files:
                    files[where] = self.digests.digest(job.name, job.path)
                digest = files[where]
            if job.lora_id in changed or digest != job.digest:
                refused.add(job.request_id)
        return frozenset(refused)

    def _listed(self) -> set[int] | None:
        """The ids vLLM holds now (None: it cannot say; what it loaded last is used)."""
        try:
            return {int(i) for i in self.manager.list_adapters()}
        except Exception:
            return None

    def take_reports(self) -> tuple[tuple[int, int, str], ...]:
        with self._guard:
            reports, self._reports = tuple(self._reports), []
        return reports

    def _warn(self) -> None:
        if not self._warned:
            self._warned = True
            logger.warning(
                "kvoffload: this worker's LoRA manager was not found (another model "
                "runner?): requests with a LoRA adapter are neither stored nor loaded"
            )
