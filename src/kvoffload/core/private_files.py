"""Opening and creating files so that no other local user can plant, read or swap
one (decision 0018): a node share's files, the disk tier's (``tiers/disk_files.py``)
and the digest cache's (:mod:`.content_digest`). Pure ``os`` calls.

Every such file lives in a directory only its owner can write
(:func:`make_private_dir`: e.g. a share's ``ROOT/kvoffload-u<UID>/NAME``, mode 0700;
or, with a configured group, ``ROOT/kvoffload-g<GID>/NAME``, mode 2770; a directory
others may list, not write, where ``others_may_read``). On top of that, every file is

- opened with ``O_NOFOLLOW | O_CLOEXEC`` and checked with ``fstat`` before it is used
  (:func:`open_checked`): a regular file, owned as :class:`FilePolicy` says, with no
  permission bits for others (and none for the group unless the group is trusted);
- created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` (:func:`create_exclusive`), its mode
  set with ``fchmod`` (the umask does not decide it); a file whose content must
  appear whole is written under a temporary name and renamed over its own
  (:func:`replace_atomically`).

The root these directories are made in (:func:`check_root`) must not let another
user rename them away: not writable by others unless sticky, and no sticky directory
on the way to it owned by another user than this one and root.

A file that fails a check is never used: the caller gets a :class:`ConfigError`
naming the policy's option (``host_share_root``, ``disk_path``), what the files belong
to, the path, what was found and what to do.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvoffload.core.errors import ConfigError

KEY = "host_share_root"
"""The option every refusal here names (where the share's files live)."""

_OPEN = os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True)
class FilePolicy:
    """Who is trusted with share ``share``'s files: this process's user (``group``
    None), or the members of group ``group``. Frozen; compares by value. ``key`` is
    the option a refusal names (``host_share_root``; the disk tier's files use the
    same checks and name ``disk_path``, ``share`` then being what the files belong
    to, e.g. ``disk tier /mnt/kv``)."""

    share: str
    group: int | None = None
    uid: int = field(default_factory=os.geteuid)
    key: str = KEY

    @property
    def subject(self) -> str:
        """What the files belong to, in messages."""
        return f"share {self.share!r}" if self.key == KEY else self.share

    @property
    def dir_mode(self) -> int:
        return 0o700 if self.group is None else 0o2770

    @property
    def file_mode(self) -> int:
        return 0o600 if self.group is None else 0o660

    def problem(self, st: os.stat_result, *, readable: bool = False) -> str | None:
        """What is wrong with a file or directory of these stats, or None: owned by
        this user with no group or other bits (``readable``: no group or other write
        bits); with a group, of that group (any owner) with no other bits."""
        mode = stat.S_IMODE(st.st_mode)
        if self.group is None:
            if st.st_uid != self.uid:
                return f"is owned by uid {st.st_uid}, not by this user (uid {self.uid})"
            if readable and mode & 0o022:
                return f"has mode {mode:04o}: others than its owner may write it"
            if not readable and mode & 0o077:
                return f"has mode {mode:04o}: others than its owner may use it"
            return None
        if st.st_gid != self.group:
            return f"belongs to group {st.st_gid}, not to host_share_group {self.group}"
        if mode & 0o007:
            return f"has mode {mode:04o}: users outside group {self.group} may use it"
        return None

    def refuse(self, path: Path | str, why: str) -> ConfigError:
        """The refusal of ``path``: the share, the path, what was found, what to do."""
        return ConfigError(
            self.key,
            f"{self.subject}: {path} {why}; kvoffload never uses a file another user could "
            f"have made: remove it (as its owner or root) or choose another {self.key}",
        )


def check_root(root: Path, policy: FilePolicy) -> None:
    """``root`` (``host_share_root``, ``disk_path``) is a directory where another user
    cannot remove or rename this user's entries: not writable by others, or sticky
    (as /tmp and /dev/shm are); and no sticky directory on the way to it, ``root``
    included, belongs to another user than this one and root
    (:func:`untrusted_sticky_dir`). Created (0700) when missing. Else a
    :class:`ConfigError` naming the policy's option, the directory, its owner and
    what to do; nothing is made in a root refused."""
    try:
        st = os.stat(root)
    except FileNotFoundError:
        untrusted = untrusted_sticky_dir(root, policy.uid)  # before making anything
        if untrusted is not None:
            raise _sticky_refusal(root, policy, *untrusted) from None
        os.makedirs(root, mode=0o700, exist_ok=True)
        st = os.stat(root)
    if not stat.S_ISDIR(st.st_mode):
        raise policy.refuse(root, "is not a directory")
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        raise ConfigError(
            policy.key,
            f"{policy.subject}: {root} is writable by every user but not sticky "
            f"(mode {stat.S_IMODE(st.st_mode):04o}): any user could replace the directory "
            "kvoffload makes in it; use a sticky directory (like /dev/shm or /tmp, mode "
            "1777) or a private one",
        )
    untrusted = untrusted_sticky_dir(root, policy.uid)
    if untrusted is not None:
        raise _sticky_refusal(root, policy, *untrusted)


def untrusted_sticky_dir(path: Path, uid: int | None = None) -> tuple[Path, int] | None:
    """The first sticky directory among ``path`` and the directories holding it (as
    written and with links resolved) that belongs to another user than ``uid`` (default:
    this process's effective one) and root, with its owner's uid; None when there is
    none. The
    owner of a sticky directory may rename or remove every entry in it, whoever made
    the entry: trusting such a directory is trusting its owner. Directories that
    cannot be examined are skipped (what cannot be statted is not used either)."""
    trusted = {0, os.geteuid() if uid is None else uid}
    seen: set[str] = set()
    for start in (os.path.abspath(path), os.path.realpath(path)):
        for directory in (Path(start), *Path(start).parents):
            if str(directory) in seen:
                continue
            seen.add(str(directory))
            try:
                st = os.stat(directory)
            except OSError:
                continue
            if st.st_mode & stat.S_ISVTX and st.st_uid not in trusted:
                return directory, st.st_uid
    return None


def _sticky_refusal(root: Path, policy: FilePolicy, directory: Path, uid: int) -> ConfigError:
    itself = directory in (Path(os.path.abspath(root)), Path(os.path.realpath(root)))
    where = "is a sticky directory" if itself else f"is in sticky directory {directory}, which is"
    return ConfigError(
        policy.key,
        f"{policy.subject}: {root} {where} owned by {_user_name(uid)}, another user: the "
        "owner of a sticky directory may rename or remove anything in it, so that user "
        "could take the directories kvoffload makes there away (or put their own in "
        f"their place); choose another {policy.key}: a directory of this user's own "
        "(mode 0700), or one in a sticky directory owned by root (like /tmp or /dev/shm)",
    )


def _user_name(uid: int) -> str:
    """``uid N (name)``, or ``uid N`` when the user has no name here."""
    import pwd

    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def make_private_dir(
    path: Path, policy: FilePolicy, *, create: bool = True, others_may_read: bool = False
) -> None:
    """Create directory ``path`` with the policy's mode (and group) unless it exists
    (``create`` False: ``FileNotFoundError`` then), then check it with ``lstat``: a
    real directory (not a link), trusted as the policy says, with the policy's mode
    bits; with ``others_may_read``, one found with more bits is accepted as long as
    no one but its owner may write it (a directory made by hand with mode 0755: its
    files are owner-only, only their names can be listed). Else a
    :class:`ConfigError`."""
    try:
        if create:
            os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    else:
        if create:
            if policy.group is not None:
                os.chown(path, -1, policy.group)
            os.chmod(path, policy.dir_mode)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise policy.refuse(path, "is a symbolic link")
    if not stat.S_ISDIR(st.st_mode):
        raise policy.refuse(path, "is not a directory")
    mode = stat.S_IMODE(st.st_mode)
    if others_may_read and policy.group is None:
        problem = policy.problem(st, readable=True)
    else:
        problem = policy.problem(st)
        if problem is None and policy.group is None and mode != 0o700:
            problem = f"has mode {mode:04o}, not 0700"
    if problem is not None:
        raise policy.refuse(path, f"(owner uid {st.st_uid}, group {st.st_gid}) {problem}")


def check_fd(fd: int, path: Path | str, policy: FilePolicy) -> os.stat_result:
    """``fstat`` of an open file: a regular file the policy trusts, else the
    :class:`ConfigError` (the descriptor is left to the caller)."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise policy.refuse(path, "is not a regular file")
    problem = policy.problem(st)
    if problem is not None:
        raise policy.refuse(path, problem)
    return st


def open_checked(path: Path | str, flags: int, policy: FilePolicy) -> int:
    """Open an existing file (``flags``: ``O_RDONLY``, ``O_RDWR``, ...) without
    following a link, and check it (:func:`check_fd`); ``FileNotFoundError`` when
    it does not exist, :class:`ConfigError` when it is a link or fails the check."""
    try:
        fd = os.open(path, flags | _OPEN)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise policy.refuse(path, "is a symbolic link") from None
        raise
    try:
        check_fd(fd, path, policy)
    except BaseException:
        os.close(fd)
        raise
    return fd


def create_exclusive(path: Path | str, flags: int, policy: FilePolicy) -> int:
    """Create ``path``, which must not exist (``FileExistsError`` otherwise), with
    the policy's mode and group whatever the umask; an open descriptor."""
    fd = os.open(path, flags | os.O_CREAT | os.O_EXCL | _OPEN, 0o600)
    try:
        if policy.group is not None:
            os.fchown(fd, -1, policy.group)
        os.fchmod(fd, policy.file_mode)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    return fd


def open_or_create(path: Path | str, flags: int, policy: FilePolicy) -> int:
    """The file at ``path``, checked (:func:`open_checked`), or created empty
    (:func:`create_exclusive`) when it does not exist; for lock and log files."""
    while True:
        try:
            return open_checked(path, flags, policy)
        except FileNotFoundError:
            pass
        try:
            return create_exclusive(path, flags, policy)
        except FileExistsError:
            continue  # made meanwhile by another process: open and check it


def temporary_name(path: Path) -> Path:
    """A fresh name beside ``path`` for a file being made (``.NAME.PID.HEX.tmp``)."""
    return path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")


def replace_atomically(path: Path, policy: FilePolicy, write: Callable[[int], None]) -> None:
    """Make ``path`` anew: a temporary file created exclusively beside it, filled by
    ``write(fd)``, then renamed over ``path`` (a reader sees the old file or the
    whole new one). On failure the temporary file is removed and ``path`` is as it
    was."""
    temporary = temporary_name(path)
    fd = create_exclusive(temporary, os.O_RDWR, policy)
    try:
        write(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    os.close(fd)
    os.replace(temporary, path)


def read_checked(path: Path | str, policy: FilePolicy, limit: int = 1 << 20) -> bytes:
    """Up to ``limit`` bytes of an existing file, opened and checked
    (:func:`open_checked`)."""
    fd = open_checked(path, os.O_RDONLY, policy)
    try:
        return os.pread(fd, limit, 0)
    finally:
        os.close(fd)


def same_file(path: Path | str, st: os.stat_result) -> bool:
    """Whether ``path`` (not followed) is still the file ``st`` describes."""
    try:
        now = os.lstat(path)
    except OSError:
        return False
    return (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino)


def resolve_group(value: object) -> int | None:
    """The gid ``host_share_group`` names (a group name, or a gid as a number or its
    digits; None: unset). A group that does not exist, or that this process is not
    a member of (root excepted), is a :class:`ConfigError` naming ``host_share_group``."""
    if value is None:
        return None
    import grp

    try:
        if isinstance(value, int) and not isinstance(value, bool):
            gid = grp.getgrgid(value).gr_gid
        elif isinstance(value, str) and value.isdigit():
            gid = grp.getgrgid(int(value)).gr_gid
        elif isinstance(value, str) and value:
            gid = grp.getgrnam(value).gr_gid
        else:
            raise KeyError(value)
    except (KeyError, OverflowError):
        raise ConfigError(
            "host_share_group", f"no such group: {value!r} (a group name or gid)"
        ) from None
    if os.geteuid() != 0 and gid != os.getegid() and gid not in os.getgroups():
        raise ConfigError(
            "host_share_group",
            f"this process (uid {os.geteuid()}) is not a member of group {value!r} "
            f"(gid {gid}): add the user to it, or leave host_share_group unset",
        )
    return gid
