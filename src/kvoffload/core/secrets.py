"""Credentials: read from a file or an environment variable, never printed.

vLLM prints the whole ``kv_transfer_config`` (``kv_connector_extra_config``
included) in its start-up log, and the JSON given to ``vllm serve`` is on the
command line for any ``ps`` to show; a password given inline is therefore in every
log and process list. kvoffload takes it from a file (``redis_password_file``) or an
environment variable (``redis_password_env``) instead, warns once when one arrives
inline, and shows none in its own reprs, errors, logs or reports (:func:`redact_url`).

Contract: the readers return the secret or raise
:class:`~kvoffload.core.errors.ConfigError` naming the option and the file or the
variable (never the secret). Nothing here logs.
"""

from __future__ import annotations

from collections.abc import Mapping
from urllib.parse import urlparse

from kvoffload.core.errors import ConfigError

HIDDEN = "***"


def redact_url(url: str) -> str:
    """``url`` with its password, if any, replaced by ``***`` (an unparsable URL is
    replaced whole: it might hold one)."""
    try:
        parsed = urlparse(url)
        if parsed.password is None:
            return url
        host = parsed.netloc.rpartition("@")[2]
        user = parsed.username or ""
    except ValueError:
        return "<unparsable URL>"
    return parsed._replace(netloc=f"{user}:{HIDDEN}@{host}").geturl()


def url_has_password(url: str) -> bool:
    try:
        return urlparse(url).password is not None
    except ValueError:
        return False


def read_secret_file(option: str, path: str) -> str:
    """The file's text without its trailing line break."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ConfigError(option, f"cannot read {path!r}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(option, f"{path!r} is not UTF-8 text") from None
    secret = text.removesuffix("\n").removesuffix("\r")
    if not secret:
        raise ConfigError(option, f"{path!r} is empty")
    return secret


def read_secret_env(option: str, name: str, environ: Mapping[str, str]) -> str:
    secret = environ.get(name)
    if not secret:
        raise ConfigError(option, f"environment variable {name} is not set or empty")
    return secret
