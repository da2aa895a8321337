"""The disk tier's directories and files: the user's own, never another user's
(the checks of decision 0018, naming ``disk_path``).

``disk_path`` may be a directory every user can write (``/tmp/kvoffload``): another
user could then have made ``kvoffload-v1`` or a namespace directory first, or put a
link or a slab of their own there, to read the chunks an engine writes or to plant
chunks it would serve. So:

- ``disk_path`` itself, when every user can write it, must be sticky (as ``/tmp``
  is): else another user could rename this user's directory in it away; and neither
  it nor a directory holding it may be a sticky directory of another user's (not
  root's, not this user's): its owner may rename anything in it
  (:func:`~kvoffload.core.private_files.check_root`, the check of a share's root);
- ``disk_path/kvoffload-v1`` and each namespace directory are created 0700, and
  checked with ``lstat`` whether created now or found: a real directory owned by this
  user that no one else can write (one made by hand with mode 0755 is accepted: its
  files are owner-only, so only their names can be listed);
- every file in them (slabs, lock, users file, the namespace record) is opened
  ``O_NOFOLLOW`` and checked with ``fstat`` (a regular file of this user's with no
  group or other bits), and created ``O_EXCL`` with mode 0600 whatever the umask.

Anything else is a :class:`~kvoffload.core.errors.ConfigError` naming ``disk_path``,
the path, what was found and what to do; nothing found there is read or written. A
disk share's slabs follow the same rule: every engine of a disk share runs as the
user that owns them (a ``host_share_group`` covers the share's runtime files only).
Pure ``os`` calls, through :mod:`kvoffload.core.private_files`.
"""

from __future__ import annotations

from pathlib import Path

from kvoffload.core.private_files import FilePolicy, check_root, make_private_dir

FORMAT_DIR = "kvoffload-v1"


def disk_policy(root: Path) -> FilePolicy:
    """The checks of the disk tier at ``root`` (refusals name ``disk_path``)."""
    return FilePolicy(f"disk tier {root}", key="disk_path")


def private_namespace_dir(root: Path, namespace_digest: bytes) -> Path:
    """``root/kvoffload-v1/<digest>``, created if missing and checked (module
    docstring); :class:`ConfigError` naming ``disk_path`` when it cannot be trusted."""
    policy = disk_policy(root)
    root = Path(root)
    check_root(root, policy)
    formats = root / FORMAT_DIR
    make_private_dir(formats, policy, others_may_read=True)
    directory = formats / namespace_digest.hex()
    make_private_dir(directory, policy, others_may_read=True)
    return directory
