"""kvoffload's log lines in vLLM's voice.

Under vLLM, loggers outside ``vllm.*`` get no handler: kvoffload's INFO lines (its
start-up summary, tier recovery, configuration notices) would be lost. The
``kvoffload`` logger therefore forwards its records to the handlers vLLM's own
``vllm`` logger has at the moment of each record (vLLM re-applies its logging
configuration at engine start, replacing those handlers), filtered by vLLM's level
(``VLLM_LOGGING_LEVEL``), so they come out in vLLM's format on vLLM's stream. Until
vLLM has configured its logging (it does so when an engine starts), records take the
root logger's way, as any library's would.

Contract: :func:`attach_to_vllm_logging` is idempotent and changes only the
``kvoffload`` logger. It does nothing when vLLM does not configure logging
(``VLLM_CONFIGURE_LOGGING=0``): the application's own logging configuration then
applies to ``kvoffload`` as to any library logger.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("kvoffload")


class ToVllmHandlers(logging.Handler):
    """Hands each record to the current handlers of the ``vllm`` logger."""

    def emit(self, record: logging.LogRecord) -> None:
        target = logging.getLogger("vllm")
        if not target.handlers:  # vLLM has not configured its logging (yet)
            root = logging.getLogger()
            if record.levelno >= root.getEffectiveLevel():
                root.handle(record)  # as if kvoffload's logger propagated
            return
        if record.levelno < target.getEffectiveLevel():
            return
        for handler in target.handlers:
            if record.levelno >= handler.level:
                handler.handle(record)


def attach_to_vllm_logging() -> bool:
    """Route the ``kvoffload`` logger through vLLM's logging; True if it is (now or
    already) attached."""
    if any(isinstance(h, ToVllmHandlers) for h in logger.handlers):
        return True
    import vllm.logger  # noqa: F401  (applies vLLM's logging configuration)

    from vllm import envs

    if not envs.VLLM_CONFIGURE_LOGGING:
        return False
    logger.addHandler(ToVllmHandlers())
    if logger.level == logging.NOTSET:  # an application's own choice stands
        logger.setLevel(logging.DEBUG)  # the forwarding handler applies vLLM's level
    logger.propagate = False
    return True
