"""kvoffload's own options (every option that is not a lower tier's), declared:
name, accepted values, default, meaning and check. :data:`~.options.OPTIONS` is
these with each tier's section between :data:`SHARE` and :data:`TAIL`.

They live apart from :mod:`.options` because that module imports the tiers' sections
(``tiers/registry.py``), so no module a tier imports (``tiers/``, ``share/``,
``core/directory/``) may import it; those read a default here, with :func:`default`.
Every other module reads :func:`.options.default`, which answers the same for these
names. Pure data and predicates; nothing here raises except :func:`option` and
:func:`default` for a name that is not one of these options.
"""

from __future__ import annotations

import grp
import re
from typing import Any

from kvoffload.codecs import CODECS, tier_codec_option
from kvoffload.core.config.sections import (
    Option,
    int_at_least,
    is_bool,
    non_negative_number,
    positive_number,
)
from kvoffload.core.errors import ConfigError
from kvoffload.core.policies import policy_names

__all__ = ["HEAD", "OWN_OPTIONS", "SHARE", "TAIL", "default", "option"]


_SHARE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def _share_name(v: Any) -> bool:
    return v is None or (isinstance(v, str) and _SHARE_NAME.match(v) is not None)


def _group(v: Any) -> bool:
    """Unset, or a group that exists (by name, gid, or gid's digits)."""
    if v is None:
        return True
    try:
        if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
            grp.getgrgid(v)
        elif isinstance(v, str) and v.isdigit():
            grp.getgrgid(int(v))
        elif isinstance(v, str) and v:
            grp.getgrnam(v)
        else:
            return False
    except (KeyError, OverflowError):
        return False
    return True


def _policy(v: Any) -> bool:
    return isinstance(v, str) and v in policy_names()


HEAD: tuple[Option, ...] = (
    Option(
        "cpu_bytes",
        "integer >= 1",
        None,
        "Host memory for offloaded chunks, in bytes, for all workers together.",
        int_at_least(1),
        required=True,
    ),
    Option(
        "chunk_tokens",
        "positive multiple of the engine block size",
        None,
        "Tokens per chunk (the unit stored, loaded and evicted). Default: the engine block size.",
        lambda v: v is None or int_at_least(1)(v),
    ),
    Option(
        "eviction",
        " | ".join(policy_names()),
        "lru",
        "Eviction policy of the host tier. slru: LRU, except that chunks reused since "
        "they were stored (up to 40% of the tier) outlive chunks not reused (decision 0014; "
        "at or above lru on every trace and workload measured, not yet the default).",
        _policy,
    ),
    Option(
        "store_threshold",
        "integer >= 1",
        1,
        "Store a chunk only after this many requests looked it up (1 stores everything).",
        int_at_least(1),
    ),
    Option(
        "copy_threads",
        "integer >= 1",
        1,
        "CPU threads per worker copying KV between engine and host memory when the KV "
        "cache is in host memory (CPU engines). 2 nearly doubles copy bandwidth but shares "
        "cores with the model.",
        int_at_least(1),
    ),
    Option(
        "tier_threads",
        "integer >= 1",
        4,
        "Threads per worker moving chunks between host memory and the tiers below it. "
        "More keep more tier requests (reads, writes, round trips) in flight; on a "
        "small machine sharing cores with a local tier server, fewer can be faster.",
        int_at_least(1),
    ),
)

SHARE: tuple[Option, ...] = (
    Option(
        "host_share",
        "a name: letters, digits, _ . - (up to 64), or unset",
        None,
        "Use the node-shared host tier of this name instead of a private one: every engine "
        "on the node naming it reads and writes one copy of each chunk in shared memory, "
        "kept when an engine exits or is killed (decision 0016; its node process starts "
        "with the first engine). cpu_bytes is then the share's size, all ranks together, "
        "if this engine creates it. A disk tier below it is shared by the node's engines "
        "naming the same disk_path, through a node process of its own (decision 0017).",
        _share_name,
    ),
    Option(
        "host_share_timeout_ms",
        "number > 0",
        5,
        "Deadline of one call to the share's node process; a call past it answers as a "
        "miss (or no room) and is counted (``kvoffload_host_share_calls_total``): a slow "
        "share never stalls a step.",
        positive_number,
    ),
    Option(
        "share_announce_ms",
        "number >= 0",
        250,
        "With vLLM's KV events on and a tier in a node share: how often each engine "
        "reads the share's announcement feed and publishes what the share made "
        "readable or removed, whichever engine stored it (routers credit every engine "
        "on the share; decision 0022). 0: each engine announces only what it stored "
        "itself, and removals its own calls caused (for comparison only: a router then "
        "misses what the other engines can load, and keeps crediting what they evicted).",
        non_negative_number,
    ),
    Option(
        "host_share_root",
        "a directory path",
        "/dev/shm",
        "Where the share's files (slabs, index, socket, meta, log) live: a memory "
        "file system for the slabs to be memory. They are in a directory of this user's "
        "own, ROOT/kvoffload-u<UID>/NAME (mode 0700; decision 0018); ROOT must not be "
        "writable by other users unless sticky (as /dev/shm and /tmp are).",
        lambda v: isinstance(v, str) and bool(v),
    ),
    Option(
        "host_share_group",
        "a group name or gid, or unset",
        None,
        "Trust the members of this group with the share's files and socket as their "
        "owner is trusted: they live in ROOT/kvoffload-g<GID>/NAME (mode 2770), files "
        "0660 of that group. Unset: only this user's processes (decision 0018). Every "
        "engine of the share must name the same group.",
        _group,
    ),
)

TAIL: tuple[Option, ...] = (
    Option(
        "tier_io_timeout_ms",
        "integer >= 1",
        5000,
        "Deadline of every lower-tier job, from its submission: a tier load or a "
        "promotion still running past it is reported failed (the engine recomputes, the "
        "request goes on; the chunks stay in the tier), a spill too; memory the stuck I/O "
        "may still write or read stays reserved until it returns "
        "(``kvoffload_tier_io_timeouts_total``).",
        int_at_least(1),
    ),
    Option(
        "lower_tier_admission",
        '"write_through" or an integer N >= 1',
        "write_through",
        "When a chunk is written below host memory: as soon as its host store completes "
        "(write_through), or after it was loaded from host memory N times.",
        lambda v: v == "write_through" or int_at_least(1)(v),
    ),
    Option(
        "codec",
        "none | lossless | fp8",
        "none",
        "How chunks are kept in every tier (decision 0023; per tier: host_codec, "
        "disk_codec, redis_codec). lossless: byte planes shuffled and zstd-coded "
        "(blosc2, the codecs extra); bit-exact; Redis holds and moves the encoded "
        "bytes (1.45x fewer on bfloat16 KV, 1.18x on float16 and float32, measured), "
        "slotted tiers keep a slot of the raw size. fp8: each value as a float8 e4m3 "
        "with a float32 scale per 4,096 values; lossy (within 2^-4 of each value plus "
        "2^-10 of its run's largest), opt-in; tiers hold 2x the chunks of 16-bit KV and "
        "4x of 32-bit KV in the same bytes, and move that much less; 16- and 32-bit "
        "float KV, coded on the GPU for KV on a GPU. An engine whose KV is already "
        "8-bit keeps none for fp8 (logged at start).",
        lambda v: v in CODECS,
    ),
    tier_codec_option("host"),
    Option(
        "lower_tier_loads",
        "direct | promote",
        "direct",
        "How a hit in a lower tier reaches the engine: read straight into the "
        "engine's blocks through a small staging area (direct: offered at once, needs no "
        "host-memory room), or first promoted into host memory while the request waits "
        "(promote: needs host room for the whole run).",
        lambda v: v in ("direct", "promote"),
    ),
    Option(
        "load_policy",
        "always | cost",
        "cost",
        "Which hits are loaded: cost offers a hit's part held by a tier only when its "
        "expected ready time (the work queued on the tier's lane plus its transfer, "
        "learned from the tier's own jobs) beats recomputing it at the engine's measured "
        "prefill speed (a slow tier's tail is recomputed, and the tier re-measured now and "
        "then by loading one chunk of a hit, so it is used again once fast; decision "
        "0013); always loads every hit, however slow its tier. "
        'A request may override it: ``"kvoffload": {"load": "always"}``.',
        lambda v: v in ("cost", "always"),
    ),
    Option(
        "prefill_tokens_per_s",
        "number > 0",
        10000.0,
        "The engine's prefill speed (tokens per second) assumed by load_policy cost until "
        "step timings measure it. A tier is loaded until its own jobs were timed (its first "
        "load measures it).",
        positive_number,
    ),
    Option(
        "seal_key_file",
        "a file path, or unset",
        None,
        "Seal every chunk written to a store other processes or machines can reach "
        "(Redis; the disk tier with disk_seal) with AES-256-GCM under the keys in this "
        "file (decision 0024): other clients of the store can neither read a chunk nor "
        "make an engine serve one they wrote. The file: at least 32 random bytes, or "
        "one key per line (hex or base64; the first seals, every key opens: "
        "``kvoffload seal-key new|rotate``), owned by this user, mode 0600. Needs the "
        "seal extra (cryptography). Unset: every client of such a store is trusted "
        "with every chunk (said at start).",
        lambda v: v is None or (isinstance(v, str) and bool(v)),
    ),
    Option(
        "seal_required",
        "true | false",
        False,
        "Refuse to start without seal_key_file when a store other processes or "
        "machines can reach is configured.",
        is_bool,
    ),
    Option(
        "metrics_port",
        "integer 1..65535",
        None,
        "Serve kvoffload's Prometheus metrics on http://127.0.0.1:<port>/metrics from the "
        "scheduler process (vLLM's own /metrics carries them too when stats are on).",
        lambda v: v is None or (int_at_least(1)(v) and v <= 65535),
    ),
    Option(
        "max_deferral_steps",
        "integer >= 1",
        500,
        "A request deferred (transfers in flight, promotion, lower-tier lookup) for this "
        "many busy engine steps (steps that ran other requests; idle steps do not count) "
        "is admitted without a hit and recomputes.",
        int_at_least(1),
    ),
    Option(
        "max_deferral_seconds",
        "number > 0",
        5.0,
        "Same bound in seconds; whichever is reached first applies.",
        positive_number,
    ),
)

OWN_OPTIONS: tuple[Option, ...] = (*HEAD, *SHARE, *TAIL)
"""kvoffload's own options, without the tiers' (in the order users see them:
:data:`~.options.OPTIONS`)."""

_BY_NAME: dict[str, Option] = {o.name: o for o in OWN_OPTIONS}


def option(name: str) -> Option:
    """kvoffload's own option ``name``; ``ConfigError`` naming ``name`` and these
    options when it is not one of them (a tier's option: :func:`.options.option`)."""
    found = _BY_NAME.get(name)
    if found is None:
        raise ConfigError(name, f"unknown option; options: {', '.join(sorted(_BY_NAME))}")
    return found


def default(name: str) -> Any:
    """The declared default of kvoffload's own option ``name`` (None: unset, or
    required); ``ConfigError`` as :func:`option`."""
    return option(name).default
