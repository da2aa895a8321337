"""The Redis/Valkey tier, declared (:data:`REDIS`): its options (URL, cluster,
timeout, credentials), its index and stores, its start-up text and warnings, its
simulator lane and its ``kvoffload inspect redis`` command.

A shared tier keyed by chunk, not authoritative: the server evicts by its own policy
and other engines add chunks (``tiers/redis_index.py``). Credentials come from a
file or an environment variable (or, discouraged, inline); they are read when the
engine starts (:func:`password`), never printed.

Importing this module imports nothing heavy (no client library); builders import
the tier's modules.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvoffload.codecs import tier_codec_option
from kvoffload.core.config.sections import (
    ConfigSection,
    Option,
    OptionValues,
    int_at_least,
    is_bool,
    non_empty_text,
    optional,
)
from kvoffload.core.errors import ConfigError
from kvoffload.core.secrets import read_secret_env, read_secret_file, redact_url
from kvoffload.tiers.redis_record import REDIS_RECORDS
from kvoffload.tiers.spec import (
    InspectCommand,
    Locality,
    OpenedIndex,
    SimLane,
    TierContext,
    TierSpec,
    TierStore,
)

if TYPE_CHECKING:
    from kvoffload.core.tiering.lower import LowerTier
    from kvoffload.tiers.redis_client import RedisSettings

logger = logging.getLogger("kvoffload")

PASSWORD_OPTIONS = ("redis_password_file", "redis_password_env", "redis_password")
PASSWORD_ENV = "REDISCLI_AUTH"  # inspect's default password, as redis-cli's


def _one_password(values: Mapping[str, Any]) -> None:
    given = [name for name in PASSWORD_OPTIONS if values[name] is not None]
    if len(given) > 1:
        raise ConfigError(given[1], f"give the Redis password one way, not also {given[0]}")
    if given and values["redis_url"] is None:
        raise ConfigError(given[0], "needs redis_url")


SECTION = ConfigSection(
    (
        Option(
            "redis_url",
            "redis://[user:password@]host:port[/db] or rediss://... (TLS)",
            None,
            "Enables the shared Redis/Valkey tier. Capacity and eviction are the server's "
            "(set maxmemory and maxmemory-policy allkeys-lru).",
            lambda v: v is None or (isinstance(v, str) and v.startswith(("redis://", "rediss://"))),
            url=True,
        ),
        Option(
            "redis_cluster",
            "true | false",
            False,
            "redis_url names a node of a Redis Cluster.",
            is_bool,
        ),
        Option(
            "redis_timeout_ms",
            "integer >= 1",
            1000,
            "Timeout of every Redis operation, connecting included; a slower server fails "
            "the operation (a miss), it never stalls the engine.",
            int_at_least(1),
        ),
        Option(
            "redis_username",
            "string",
            None,
            "Redis username (overrides the URL's).",
            lambda v: v is None or isinstance(v, str),
        ),
        Option(
            "redis_password_file",
            "a file path",
            None,
            "Read the Redis password from this file (its text without the final line "
            "break; make it readable by the serving user only). The way to give a password: "
            "it never appears in vLLM's start-up log or the process list. Overrides the URL's.",
            optional(non_empty_text),
        ),
        Option(
            "redis_password_env",
            "an environment variable name",
            None,
            "Read the Redis password from this environment variable of the serving "
            "process. Overrides the URL's.",
            lambda v: v is None or (isinstance(v, str) and bool(v) and "=" not in v),
        ),
        Option(
            "redis_password",
            "string",
            None,
            "Redis password given inline (overrides the URL's). Discouraged: vLLM logs "
            "kv_connector_extra_config at start-up and the command line is visible to ps; "
            "kvoffload warns once. Use redis_password_file or redis_password_env.",
            lambda v: v is None or isinstance(v, str),
            secret=True,
        ),
        tier_codec_option("redis"),
    ),
    _one_password,
)


def enabled(config: OptionValues) -> bool:
    return config.option("redis_url") is not None


def password(config: OptionValues, environ: Mapping[str, str] | None = None) -> str | None:
    """The Redis password from ``redis_password_file``, ``redis_password_env`` or
    ``redis_password`` (whichever is set; None: the URL's own, if any). Reads the
    file or the environment now; raises :class:`ConfigError` naming the option when
    it cannot."""
    if config.option("redis_password_file") is not None:
        return read_secret_file("redis_password_file", config.option("redis_password_file"))
    if config.option("redis_password_env") is not None:
        env = os.environ if environ is None else environ
        return read_secret_env("redis_password_env", config.option("redis_password_env"), env)
    value: str | None = config.option("redis_password")
    return value


def settings(config: OptionValues) -> RedisSettings:
    """The client settings of ``config`` (the password read now)."""
    from kvoffload.tiers.redis_client import RedisSettings

    url = config.option("redis_url")
    if url is None:
        raise ConfigError("redis_url", "is not set")
    return RedisSettings(
        url=url,
        cluster=config.option("redis_cluster"),
        timeout_ms=config.option("redis_timeout_ms"),
        username=config.option("redis_username"),
        password=password(config),
    )


def _no_slots(config: OptionValues, chunk_bytes: int, world_size: int) -> int:
    return 0  # keyed by chunk; the capacity is the server's maxmemory


def probe(client: Any, config: OptionValues) -> None:
    """Warn when the Redis server does not answer a PING now."""
    try:
        client.ping()
    except Exception as exc:
        logger.warning(
            "kvoffload: Redis at %s does not answer (%s: %s); the Redis tier misses until it does",
            redact_url(config.option("redis_url") or ""),
            type(exc).__name__,
            " ".join(str(exc).split())[:200],
        )


def open_index(config: OptionValues, ctx: TierContext) -> OpenedIndex[LowerTier]:
    """The cached view of what the server holds (a server that does not answer is
    warned about, then missed until it does); the namespace's record written."""
    from kvoffload.tiers.namespace_records import record_namespace
    from kvoffload.tiers.redis_client import make_client
    from kvoffload.tiers.redis_index import RedisIndex

    client = make_client(settings(config))
    probe(client, config)
    record_namespace(REDIS_RECORDS, client, ctx.namespace)
    index = RedisIndex(client, ctx.namespace.digest(), ctx.world_size)
    return OpenedIndex(index, index.close)


def open_store(config: OptionValues, ctx: TierContext) -> TierStore:
    from kvoffload.tiers.redis_client import make_client
    from kvoffload.tiers.redis_store import RedisStore

    client = make_client(settings(config))
    # lossless chunks are stored at their encoded size (decision 0023)
    variable = (config.option("redis_codec") or config.option("codec")) == "lossless"
    return RedisStore(
        client, ctx.namespace.digest(), ctx.rank, ctx.chunk_bytes, ctx.groups, variable=variable
    )


def password_source(config: OptionValues) -> str:
    if config.option("redis_password_file") is not None:
        return "password from redis_password_file"
    if config.option("redis_password_env") is not None:
        return f"password from ${config.option('redis_password_env')}"
    if config.inline_secret() is not None:
        return "password inline"
    return "no password"


def describe(config: OptionValues, chunks: int) -> str:
    kind = "redis cluster" if config.option("redis_cluster") else "redis"
    return f"{kind} {redact_url(config.option('redis_url'))} ({password_source(config)})"


def warn_inline_secret(config: OptionValues) -> None:
    where = config.inline_secret()
    if where is not None:
        logger.warning(
            "kvoffload: the Redis password is given inline (%s); vLLM prints "
            "kv_connector_extra_config in its start-up log and the command line is visible "
            "to ps. Put it in a file (redis_password_file) or an environment variable "
            "(redis_password_env) instead.",
            where,
        )


def _inspect_arguments(parser: argparse.ArgumentParser) -> None:
    from kvoffload.inspection.arguments import positive_int

    parser.add_argument(
        "url",
        metavar="URL",
        help="redis://[user:password@]host:port[/db] or rediss://... (TLS; certificates "
        "in the query, e.g. ?ssl_ca_certs=/etc/ca.pem), as the tier's redis_url",
    )
    parser.add_argument("--cluster", action="store_true", help="URL names a Redis Cluster node")
    parser.add_argument("--username", help="ACL user (overrides the URL's)")
    parser.add_argument(
        "--password",
        help=f"password (overrides the URL's); default: ${PASSWORD_ENV} when set",
    )
    parser.add_argument(
        "--timeout-ms",
        type=positive_int,
        default=2000,
        metavar="MS",
        help="timeout for connecting and for every command (default 2000)",
    )


def _inspect(args: argparse.Namespace) -> Any:
    from kvoffload.inspection.redis_scan import inspect_redis

    return inspect_redis(
        args.url,
        namespace=args.namespace,
        verify=args.verify,
        world_size=args.world_size,
        cluster=args.cluster,
        username=args.username,
        password=args.password if args.password is not None else os.environ.get(PASSWORD_ENV),
        timeout_ms=args.timeout_ms,
    )


def settle(config: OptionValues) -> None:
    """Read the password now, when the tier is on: a password file or variable that
    cannot be read fails at start (``ConfigError`` naming the option)."""
    if enabled(config):
        password(config)


REDIS: TierSpec[LowerTier, TierStore] = TierSpec(
    name="redis",
    medium="STORAGE",
    locality=Locality.REMOTE,
    section=SECTION,
    enabled=enabled,
    slots=_no_slots,
    open_index=open_index,
    open_store=open_store,
    describe=describe,
    warn=warn_inline_secret,
    settle=settle,
    sim=SimLane(
        gbps=1.25,  # 10 GbE
        bytes_help="redis tier capacity (default 0: none)",
        gbps_help="redis tier bandwidth, both directions",
        keyed=True,
    ),
    inspect=InspectCommand(
        help="a Redis/Valkey server or cluster",
        description="Inspect kvoffload's values in a Redis/Valkey server (read-only: "
        "SCAN, STRLEN, GETRANGE, GET, INFO).",
        verify_help="read every file or value in full and check header and checksum; "
        "exit status 1 if any is bad",
        world_help="ranks per chunk (a chunk is complete when ranks 0..N-1 are all there); "
        "default: the highest rank seen + 1",
        add=_inspect_arguments,
        run=_inspect,
    ),
    records=REDIS_RECORDS,
    seals=lambda config: True,  # every client of the server reaches its values
)
