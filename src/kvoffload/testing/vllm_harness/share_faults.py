"""Share-lifecycle faults of a harness fleet (test support; decision 0018): what an
operator or the system does to a node-shared host tier under live engines.

- :func:`stop_share`: ``kvoffload share stop`` (the verified stop, waited for), then
  ``kvoffload share remove``, which must refuse while engines are attached and leave
  every file of the share (both checked); the engines start a node process on their
  own when they call next, over the same slab files;
- :func:`wipe_share`: the share root's per-user directory deleted wholesale (what
  systemd's ``RemoveIPC`` does to /dev/shm), its node processes killed first or left
  alive: the next node process makes new slab files, and the engines' workers must
  move to them before any store of theirs is made readable there.

Both count themselves in the fleet's ``stats`` (``share_stops``, ``share_wipes``)
and clear its provenance (the next node process starts empty).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from kvoffload.share.lifecycle import remove_share
from kvoffload.testing.vllm_harness.checks import HarnessViolation
from kvoffload.testing.vllm_harness.fleet import SharedFleet


def stop_share(fleet: SharedFleet) -> None:
    """``kvoffload share stop`` under live engines (verified, waited for), then
    ``kvoffload share remove``, which must refuse (the engines are attached) and
    leave every file of the share as it was; the engines start a node process on
    their own when they call next. Nothing happens when no engine lives or no
    node process runs."""
    if not fleet.live() or not fleet.host.stop_node(fleet.noticed):
        return
    fleet.stored.clear()  # the next node process starts empty
    files = sorted(os.listdir(fleet.paths.dir))
    code, line = remove_share(fleet.paths)
    if code == 0 or "engines are attached" not in line:
        raise HarnessViolation(f"share remove under live engines: {line}")
    if sorted(os.listdir(fleet.paths.dir)) != files:
        raise HarnessViolation("a refused share remove changed the share's files")
    fleet.stats["share_stops"] += 1


def wipe_share(fleet: SharedFleet, kill_first: bool) -> None:
    """The share root's per-user directory deleted wholesale (what systemd's
    ``RemoveIPC`` does to /dev/shm), the node processes killed first or alive (a
    live one leaves at its next ``prepare_store``: see
    :meth:`~.share_watch.ShareWatch.left_deleted_files`). Every live engine goes
    on; the next node process makes new slab files."""
    if kill_first:
        fleet.kill_node()
        fleet.kill_disk_node()
    host = fleet.host.running()
    disk = fleet.disk.running() if fleet.disk is not None else None
    _remove_tree(fleet.paths.user_dir)
    fleet.host.left_deleted_files(host, fleet.noticed)
    if fleet.disk is not None:
        fleet.disk.left_deleted_files(disk, fleet.disk.noticed(fleet.live()))
    fleet.stored.clear()  # the next node process starts empty, in new files
    fleet.stats["share_wipes"] += 1


def _remove_tree(path: Path) -> None:
    """Delete ``path`` wholesale; again while a lease thread that was reconnecting
    made a lock file in it meanwhile (as it may under ``RemoveIPC`` too)."""
    for _ in range(100):
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            return
    raise HarnessViolation(f"{path} could not be deleted")
