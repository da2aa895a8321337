"""What changes a harness engine's weights and caches from outside its engine loop:
vLLM's connector handshake at start, ``reset_prefix_cache`` (with or without the
connector), an RL framework's in-place weight update followed by vLLM's default
reset, weights loaded anew with no reset (decisions 0005, 0019), and vLLM's sleep
mode: :meth:`WeightEvents.sleep_engine` and :meth:`WeightEvents.wake_engine` in vLLM
0.33's order (decision 0021). The fake model's
``version`` stands for the weights; every change of it is what a worker's fingerprint
sees.

A mixin of :class:`~kvoffload.testing.vllm_harness.harness.VllmHarness`, which owns the
state it names; these calls run between engine steps, as in a paused engine.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from vllm.v1.core.sched.interface import PauseState
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from kvoffload.testing.vllm_harness.checks import HarnessViolation
from kvoffload.testing.vllm_harness.hangs import settle
from kvoffload.testing.vllm_harness.kv_model import KVModel
from kvoffload.testing.vllm_harness.ranks import Rank
from kvoffload.testing.vllm_harness.units import Unit


class WeightEvents:
    scheduler: Scheduler
    model: KVModel
    units: list[Unit]
    ranks: list[Rank]
    trace: list[str]
    kv: list[torch.Tensor]
    step: Callable[..., object]
    sleeps: int = 0  # sleep_engine calls that released the KV memory

    def handshake(self) -> None:
        """vLLM's connector handshake at engine start: each rank's metadata to the
        scheduler's connector (kvoffload's weights fingerprints, when it is the engine's
        connector itself; under ``MultiConnector`` none, as in vLLM)."""
        found = {}
        for entry in self.ranks:
            meta = entry.connector.get_handshake_metadata()
            if meta is not None:
                found[(0, entry.rank)] = meta
        connector = self.scheduler.connector
        if found and connector is not None:
            connector.set_xfer_handshake_metadata_pp_aware(found)

    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        """vLLM's reset; a successful reset of the connector changes the weights
        (the model's version): any KV from before would now be wrong."""
        done = bool(self.scheduler.reset_prefix_cache(reset_running_requests, reset_connector))
        if reset_connector:
            for unit in self.units:
                unit.checks.connector_reset()
            if done:
                self.model.version += 1
        self.trace.append(
            f"! reset (running {reset_running_requests}, connector {reset_connector}) -> {done}"
        )
        return done

    def update_weights(self, reset_running_requests: bool = False) -> bool:
        """An RL framework's weight update: the weights change in place (the fake
        model's version), then vLLM's default reset of the prefix cache (the connector
        is not told). Only done when that reset succeeds (vLLM refuses it while blocks
        are in use, unless ``reset_running_requests``; the framework would retry):
        whether the weights changed. No step runs between the two, as in a paused
        engine."""
        try:
            done = bool(self.scheduler.reset_prefix_cache(reset_running_requests, False))
        except RuntimeError:  # vLLM: blocks still held by loads in flight
            done = False
        if done:
            self.model.version += 1
        self.trace.append(f"! weights updated (running {reset_running_requests}) -> {done}")
        return done

    def load_weights(self) -> None:
        """Weights loaded anew through the model's ``load_weights`` (vLLM's
        ``reload_weights``, an update call) while the engine is idle, with no reset:
        every worker fingerprints them before the next plan's jobs run, on its own."""
        self.model.version += 1
        for entry in self.ranks:
            for child in entry.children:
                child.side.weights.note_loaded()
        self.trace.append("! weights loaded")

    def sleep_engine(self, level: int = 1) -> list[str]:
        """vLLM 0.33's ``EngineCore.sleep(level)`` in abort mode: every request aborted,
        the scheduler paused (``PAUSED_NEW``), the engine stepped until no request is
        left (the engine process's ``_pause_complete``: loads in flight for aborted
        requests still hold their blocks; vLLM also waits for kvoffload's pending
        jobs, the harness does not, so tier jobs the policy holds may straddle the
        sleep), and for level 1 and up its caches reset
        with the connectors (``_finish_pause``: a failed reset fails the sleep), then
        the workers' ``sleep``: each kvoffload connector's ``unregister_kv_caches``
        (under ``MultiConnector``, each child's, as 0.33's does) before the KV memory
        is released, which the harness stands for by overwriting every KV tensor. The
        transfers the policy still holds are let through first: a real copy or tier
        read ends on its own. The weights stay (a level-2 sleep that reloads the same
        weights); :meth:`wake_engine` may change them. Returns the ids of the requests
        aborted."""
        aborted = self.scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED)
        self.scheduler.set_pause_state(PauseState.PAUSED_NEW)
        self.trace.append(f"! sleep (level {level})")
        for _ in range(500):
            s = self.scheduler
            if not (s.has_unfinished_requests() or s.has_finished_requests()):
                break
            self.step()
        else:
            raise HarnessViolation("sleep: requests still held after 500 steps")
        if level < 1:
            return [r.request_id for r in aborted]
        if not self.scheduler.reset_prefix_cache(True, True):
            raise HarnessViolation("sleep: the connector reset failed")
        for entry in self.ranks:
            for child in entry.children:
                for lane in child.lanes():
                    lane.release(set(lane.held))
                    settle(lane, entry.rank, child.hangs)
                child.gate.release(set(child.open_copies))
                child.connector.unregister_kv_caches()
        for kv in self.kv:
            kv.fill_(-7.0)  # the memory went to someone else
        self.sleeps += 1
        return [r.request_id for r in aborted]

    def wake_engine(self, weights_changed: bool = False) -> None:
        """vLLM 0.33's ``wake_up()``: the workers get their memory back and each
        kvoffload connector's ``restore_kv_caches`` runs, the connector handshake is
        made again, and the scheduler resumes. ``weights_changed``: the weights came
        back other than they were (a level-2 sleep with new weights loaded, an RL
        update while asleep) without passing through ``load_weights``: only the check
        the sleep's reset asked for can tell."""
        if weights_changed:
            self.model.version += 1
        for entry in self.ranks:
            for child in entry.children:
                child.connector.restore_kv_caches()
        self.handshake()
        self.scheduler.set_pause_state(PauseState.UNPAUSED)
        self.trace.append(f"! wake (weights changed {weights_changed})")
