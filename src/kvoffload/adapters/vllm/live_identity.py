"""The weights a worker serves, fingerprinted from what vLLM built (decision 0019).

:class:`LiveWeights` finds the worker's model (the model runner that registers the
KV caches: the first caller up the stack with a ``get_model()`` that returns a torch
module) and fingerprints, on the model's own device (:mod:`kvoffload.transfer.fingerprint`):

- every parameter and persistent buffer, by name (what a weight update changes: an
  in-place scale through ``collective_rpc``, ``reload_weights``, an RL framework's
  update). Non-persistent buffers (rotary caches) are left out: they are computed
  from the configuration, and their last bits may differ between devices;
- the attributes of every rotary embedding vLLM built (modules of
  ``vllm.model_executor.layers.rotary_embedding``): the choices they made at build
  time, e.g. LongRoPE's short or long factors, picked from ``max_model_len``. What
  vLLM chose is read, not a list of the settings it may read;
- the checksum of every tensor that passed through the model's ``load_weights``
  since the worker started (wrapped on the model instance): the path vLLM's
  ``reload_weights`` and weight-update calls and RL frameworks take. Weights a
  backend repacks out of the module's parameters when they load (vLLM's CPU build
  packs linear weights into oneDNN handles and leaves empty parameters) are seen
  here when they are updated, and through the weight files' content digest at start
  (:mod:`kvoffload.core.identity.model`).

A call through the wrapped ``load_weights`` marks the fingerprint dirty: the worker
fingerprints again before it runs its next plan's jobs. A worker whose model cannot
be found (another model runner, a test) gets :data:`UNIDENTIFIED` for good and says
so once in its log; its keys then rest on the configuration and weight files alone.

Owned by one worker half; one thread calls it (the worker's), except the wrapped
``load_weights``, which runs in whichever thread vLLM loads weights from and only
records checksums and the dirty flag.
"""

from __future__ import annotations

import logging
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from types import FrameType
from typing import Any

import torch

from kvoffload.core.identity import model as model_identity
from kvoffload.transfer.fingerprint import checksum, fingerprint

logger = logging.getLogger("kvoffload")

UNIDENTIFIED = b"kvoffload/weights-not-identified"
"""The fingerprint of a worker that could not find its model."""

ROTARY_MODULES = "vllm.model_executor.layers.rotary_embedding"
_MAX_FRAMES = 40


class LiveWeights:
    """One worker's view of its model's weights (see the module docstring)."""

    def __init__(self, runner: Any) -> None:
        self._runner = weakref.ref(runner)
        self._guard = threading.Lock()
        self._loaded: dict[str, torch.Tensor] = {}  # name -> checksum, via load_weights
        self._wrapped: weakref.ReferenceType[torch.nn.Module] | None = None
        self.dirty = False  # a load_weights call since the last fingerprint

    @classmethod
    def find(cls) -> LiveWeights | None:
        """The model runner up the calling stack (``register_kv_caches`` is called by
        it, or by a helper it called), or None."""
        frame: FrameType | None = sys._getframe(1)
        for _ in range(_MAX_FRAMES):
            if frame is None:
                return None
            owner = frame.f_locals.get("self")
            if owner is not None and _model_of(owner) is not None:
                return cls(owner)
            frame = frame.f_back
        return None

    def runner(self) -> object | None:
        """The model runner found (None once it is gone)."""
        return self._runner()

    def model(self) -> torch.nn.Module | None:
        runner = self._runner()
        return None if runner is None else _model_of(runner)

    def fingerprint(self) -> bytes:
        """The weights' fingerprint now (clears ``dirty``); :data:`UNIDENTIFIED`
        once the model is gone."""
        model = self.model()
        if model is None:
            return UNIDENTIFIED
        self._wrap(model)
        with self._guard:
            self.dirty = False
            loaded = sorted(self._loaded.items())
        tensors: list[tuple[str, torch.Tensor]] = []
        for module_name, module in model.named_modules():
            skip: set[str] = getattr(module, "_non_persistent_buffers_set", set())
            for name, tensor in module._parameters.items():
                if tensor is not None:
                    tensors.append((f"{module_name}.{name}", tensor))
            for name, tensor in module._buffers.items():
                if tensor is not None and name not in skip:
                    tensors.append((f"{module_name}.{name}#buffer", tensor))
        # Checksums already taken as the weights were loaded.
        extra = model_identity.digest_of(
            {"rotary": rotary_choices(model), "loaded": [name for name, _ in loaded]}
        ).encode()
        sums = [(f"loaded:{name}", pair) for name, pair in loaded]
        return fingerprint([*tensors, *sums], extra)

    def _wrap(self, model: torch.nn.Module) -> None:
        """Route the model's ``load_weights`` through :meth:`_note` (once per model
        object: a model loaded anew is wrapped anew)."""
        if self._wrapped is not None and self._wrapped() is model:
            return
        original = getattr(model, "load_weights", None)
        if not callable(original):
            return
        owner = self

        def load_weights(
            weights: Iterable[tuple[str, torch.Tensor]], *args: Any, **kwargs: Any
        ) -> Any:
            owner.dirty = True
            return original(owner._note(weights), *args, **kwargs)

        object.__setattr__(model, "load_weights", load_weights)  # on the instance only
        self._wrapped = weakref.ref(model)

    def _note(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if isinstance(tensor, torch.Tensor):
                summed = checksum(tensor)
                with self._guard:
                    self._loaded[str(name)] = summed
                    self.dirty = True
            yield name, tensor


def live_weights_source(found: LiveWeights | None) -> Callable[[], bytes]:
    """The worker's fingerprint function: ``found``'s, or :data:`UNIDENTIFIED`."""
    if found is None:
        logger.warning(
            "kvoffload: this worker's model was not found; weights updated in place are "
            "not detected (reset the connector after a weight update: "
            "reset_prefix_cache(reset_connector=True))"
        )
        return lambda: UNIDENTIFIED
    return found.fingerprint


def rotary_choices(model: torch.nn.Module) -> list[object]:
    """Each rotary embedding's class and plain attributes (bools, numbers, strings
    and lists of them), by module name: the choices vLLM made when it built them."""
    out: list[object] = []
    for name, module in model.named_modules():
        cls = type(module)
        if not cls.__module__.startswith(ROTARY_MODULES):
            continue
        plain = {k: v for k, v in vars(module).items() if not k.startswith("_") and _plain(v)}
        out.append([name, cls.__qualname__, model_identity.canonical(plain)])
    return out


def _plain(value: object) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return False


def _model_of(owner: object) -> torch.nn.Module | None:
    get_model = getattr(owner, "get_model", None)
    if not callable(get_model):
        return None
    try:
        model = get_model()
    except Exception:  # a runner whose model is not loaded (yet)
        return None
    return model if isinstance(model, torch.nn.Module) else None
