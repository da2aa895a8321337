"""Exceptions raised by kvoffload.

Contract: configuration problems raise :class:`ConfigError` at start-up, naming the
field and the accepted values. :class:`ContractViolation` means a caller broke a
documented precondition (a bug in the caller, never a transfer failure); transfer
failures are values (failed results), never exceptions.
"""

from __future__ import annotations


class KvOffloadError(Exception):
    """Base class of every exception kvoffload raises on purpose."""


class ConfigError(KvOffloadError, ValueError):
    """Invalid configuration. The message names the field and the accepted values."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"kvoffload config '{field}': {message}")
        self.field = field


class UsageError(KvOffloadError):
    """A command-line problem (bad arguments, unreadable input, unreachable server);
    the ``kvoffload`` command prints it as one line and exits with status 2."""


class ContractViolation(KvOffloadError, RuntimeError):
    """A caller broke a documented precondition of a core operation."""


class IllegalTransition(ContractViolation):
    """A state machine was asked for a transition its table does not allow."""


class DirectoryUnavailable(KvOffloadError):
    """A directory kept by another process (a node-shared tier) did not answer a call
    whose contract has no miss (``prepare_load``, ``slots_of``, ``groups_of``). The
    caller books nothing and treats what it asked for as a miss; a private
    :class:`~kvoffload.core.directory.Directory` never raises it."""
