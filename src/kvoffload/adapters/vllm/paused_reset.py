"""Whether a connector reset comes from a paused vLLM scheduler (decision 0021).

vLLM resets every connector (``reset_prefix_cache(reset_running_requests=True,
reset_connector=True)``) when it pauses its scheduler with ``clear_cache`` (the first
step of ``sleep(level >= 1)``, and of ``pause_generation``, which RL frameworks call
around a weight sync), after it set the scheduler's pause state. Such a reset frees
vLLM's memory; it does not say that what kvoffload holds is wrong: the weights may
well be the same after the wake-up. A reset while the scheduler runs is a user's
explicit clear.

vLLM does not tell a connector why it resets, so :func:`paused_scheduler` walks up
the calling stack of ``reset_cache`` to the first frame whose ``self`` is a vLLM
scheduler (directly, or through ``MultiConnector``) and reads its ``pause_state``,
the way ``live_identity.py`` finds the worker's model up the stack of
``register_kv_caches``. Never raises.
"""

from __future__ import annotations

import sys
from types import FrameType

from kvoffload.adapters.vllm.compat import PauseState, SchedulerInterface

_MAX_FRAMES = 40


def paused_scheduler() -> bool:
    """True when a vLLM scheduler up the calling stack is paused (its ``pause_state``
    is not ``UNPAUSED``); False when it runs, or none is found (a direct call, a
    vLLM without pause states)."""
    try:
        frame: FrameType | None = sys._getframe(1)
        for _ in range(_MAX_FRAMES):
            if frame is None:
                return False
            owner = frame.f_locals.get("self")
            if isinstance(owner, SchedulerInterface):
                state = getattr(owner, "pause_state", None)
                return state is not None and state != PauseState.UNPAUSED
            frame = frame.f_back
    except Exception:  # a frame kvoffload cannot read: an ordinary reset
        return False
    return False
