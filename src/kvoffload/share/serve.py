"""``kvoffload share serve NAME``: run a share's node process in the foreground
(for a systemd unit; engines also start it by themselves, see :mod:`.launch`).

``kvoffload share stop NAME`` sends SIGTERM to the share's node process, once it
verified that it is that (and waits until it exited); ``kvoffload share remove NAME``
deletes the files of a share that is stopped and that no engine is attached to (its
memory goes back to the system when no process maps it any more): see
:mod:`.lifecycle`. Both print one line; a refusal exits with status 1.

A share's node process is ``python -m`` its backing's module (:mod:`.backing`): this
one for shared-memory slabs (:class:`~.memory_backing.MemoryBacking`), another
backing's (e.g. the disk tier's) with its own options (e.g. where its files are),
whose NAME, derived from them, may then be left out (given, it must match). ``stop``
and ``remove`` work for any share by name; ``remove`` deletes its runtime files under
``--root``, never another backing's files.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from kvoffload.core.config.own_options import default
from kvoffload.core.directory.admission import MAX_ADMISSION_COUNTERS
from kvoffload.core.errors import KvOffloadError, UsageError
from kvoffload.core.private_files import resolve_group
from kvoffload.share.backing import Backing, BackingOptions
from kvoffload.share.lifecycle import remove_share, stop_share
from kvoffload.share.memory_backing import MemoryBackingOptions
from kvoffload.share.meta import ShareGeometry
from kvoffload.share.paths import DEFAULT_ROOT, SharePaths
from kvoffload.share.server import ShareServer
from kvoffload.share.server_start import AlreadyServing, open_server


def main(argv: list[str] | None = None, options: BackingOptions | None = None) -> int:
    """The command, for a share over the backing ``options`` parse (shared-memory
    slabs when None, see :mod:`.backing`)."""
    options = MemoryBackingOptions() if options is None else options
    parser = argparse.ArgumentParser(prog="kvoffload share", description=__doc__)
    parser.add_argument("action", choices=("serve", "stop", "remove"))
    parser.add_argument("name", nargs="?", help="the share (derived for a backed share)")
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT)
    parser.add_argument("--group", help="host_share_group: the group trusted with it")
    options.add_arguments(parser)
    parser.add_argument("--cpu-bytes", type=int, help="size of a new share (all ranks)")
    parser.add_argument("--slots", type=int, help="slots of a new share (instead of size)")
    parser.add_argument("--slot-bytes", type=int, help="bytes of one chunk of one rank")
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--policy", default=default("eviction"))
    parser.add_argument("--store-threshold", type=int, default=default("store_threshold"))
    parser.add_argument("--max-admission-counters", type=int, default=MAX_ADMISSION_COUNTERS)
    parser.add_argument("--ready-fd", type=int, default=-1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    backing = options.from_arguments(args)
    name = backing.share_name()
    if args.name is not None and args.name != name:
        raise UsageError(f"this share is named {name}, not {args.name}")
    paths = SharePaths(name, args.root, resolve_group(args.group))
    if args.action in ("stop", "remove"):
        code, line = (stop_share if args.action == "stop" else remove_share)(paths)
        print(f"kvoffload share {args.action}: {line}", file=sys.stderr if code else sys.stdout)
        return code
    return _serve(paths, _geometry(args), args.ready_fd, backing)


def _geometry(args: argparse.Namespace) -> ShareGeometry | None:
    if args.slot_bytes is None:
        return None
    if args.slots is not None:
        return ShareGeometry(
            args.slots, args.slot_bytes, args.ranks, args.policy,
            args.store_threshold, args.max_admission_counters,
        )  # fmt: skip
    if args.cpu_bytes is None:
        raise UsageError("a new share needs --cpu-bytes (or --slots) with --slot-bytes")
    geometry = ShareGeometry.for_budget(
        args.cpu_bytes, args.slot_bytes, args.ranks,
        policy=args.policy, store_threshold=args.store_threshold,
    )  # fmt: skip
    return geometry


def _serve(
    paths: SharePaths, geometry: ShareGeometry | None, ready_fd: int, backing: Backing
) -> int:
    """Serve until SIGTERM/SIGINT. Signal handlers are in place before readiness is
    reported (closing ``ready_fd``), so a stop right after start-up stops cleanly. A
    share that cannot be served (e.g. a private engine holds a disk share's namespace)
    is one line on standard error (the share's log), written before readiness is
    reported, and exit status 2."""
    running: list[ShareServer] = []

    def _stop_serving(signum: int, frame: object) -> None:
        if not running:
            raise SystemExit(0)  # still starting: nothing to close yet
        running[0].stop()

    signal.signal(signal.SIGTERM, _stop_serving)
    signal.signal(signal.SIGINT, _stop_serving)
    try:
        running.append(open_server(paths, geometry, backing))
    except AlreadyServing:
        return 0
    except (KvOffloadError, OSError) as exc:  # said before readiness: the starter reads it
        print(f"kvoffload share {paths.name}: cannot serve: {_one_line(exc)}", file=sys.stderr)
        sys.stderr.flush()
        return 2
    finally:
        if ready_fd >= 0:
            os.close(ready_fd)  # the starter's wait ends: listening, or not needed
    running[0].serve_forever()
    return 0


def node_process_main(argv: list[str], options: BackingOptions | None = None) -> int:
    """``python -m`` a backing's module with its ``options`` (this one, shared-memory
    slabs, when None): how an engine starts a node process. A share that cannot be
    served is one line in the share's log and exit status 2."""
    try:
        return main(["serve", *argv], options)
    except (KvOffloadError, OSError) as exc:
        print(f"kvoffload share: cannot serve: {_one_line(exc)}", file=sys.stderr, flush=True)
        return 2


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


if __name__ == "__main__":
    sys.exit(node_process_main(sys.argv[1:]))
