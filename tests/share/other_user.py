"""Another local user, played by a forked child of the test process that drops to
``nobody`` (uid and gid 65534) before it does anything (the tests run as root, as CI
does). What it tried comes back as one JSON value through a pipe."""

from __future__ import annotations

import json
import os
import traceback
from collections.abc import Callable
from typing import Any

NOBODY = 65534


def as_other_user(action: Callable[[], Any], gid: int = NOBODY) -> Any:
    """Run ``action`` in a child process as uid 65534 (primary group ``gid``, no
    supplementary groups) and return what it returned (JSON-able); an exception in
    the child is re-raised here as an ``AssertionError`` with its traceback."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.close(read_fd)
        try:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(NOBODY)
            answer = {"ok": action()}
        except BaseException:
            answer = {"error": traceback.format_exc()}
        with os.fdopen(write_fd, "w") as out:
            out.write(json.dumps(answer))
        os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd) as answers:
        raw = answers.read()
    os.waitpid(pid, 0)
    answer = json.loads(raw)
    if "error" in answer:
        raise AssertionError(f"the other user's action failed:\n{answer['error']}")
    return answer["ok"]


def outcome(call: Callable[[], object]) -> str:
    """What a call the other user tries ends with: ``"ok"`` or the error's name
    (``"PermissionError"``, ...)."""
    try:
        call()
    except OSError as exc:
        return type(exc).__name__
    return "ok"
