"""Reading a running engine's kvoffload metrics: one HTTP GET of a Prometheus endpoint.

``inspect_metrics(url, timeout_ms)`` fetches the exposition at ``url`` (kvoffload's
own endpoint, ``metrics_port``: ``http://127.0.0.1:<port>/metrics``, or vLLM's
``/metrics``) and returns the tier hierarchy's :class:`~.tier_health.HealthReport`.
:func:`metrics_url` completes the URL first: ``http://`` when it has no scheme,
``/metrics`` when it has no path (or only ``/``).

Contract: one GET and nothing else (environment proxies are not used: the endpoint
is normally on the loopback interface); ``timeout_ms`` bounds connecting and each
read; at most :data:`MAX_BYTES` are read. Every expected failure raises
:class:`~kvoffload.core.errors.UsageError` as one line naming the URL (a password in
it shown as ``***``): a bad URL, a refused or timed-out connection, an HTTP error
status, a body that is not UTF-8 Prometheus text exposition, or one without any
kvoffload metric.
"""

from __future__ import annotations

import http.client
import urllib.error
import urllib.request
from urllib.parse import urlsplit, urlunsplit

from kvoffload.core.errors import UsageError
from kvoffload.core.secrets import redact_url
from kvoffload.inspection.exposition import ExpositionError, parse_exposition
from kvoffload.inspection.tier_health import HealthReport, has_kvoffload_metrics, tier_health

DEFAULT_PATH = "/metrics"
MAX_BYTES = 64 << 20
"""A body larger than this is refused (vLLM's whole /metrics is well under 1 MiB)."""
ACCEPT = "text/plain; version=0.0.4"
"""The classic text format (an OpenMetrics answer parses as well)."""


def metrics_url(url: str) -> str:
    """``url`` completed (module docstring); :class:`UsageError` when it is not an
    ``http://`` or ``https://`` URL with a host and a valid port and no credentials."""
    text = url.strip()
    if "://" not in text:
        text = "http://" + text
    where = redact_url(text)
    try:
        parts = urlsplit(text)
        _ = parts.port  # parsed only when read: ValueError for a bad port
        has_credentials = parts.username is not None or parts.password is not None
    except ValueError as exc:
        raise UsageError(f"{where!r} is not a valid URL ({exc})") from None
    if parts.scheme not in ("http", "https"):
        raise UsageError(f"{where!r} is not an http:// or https:// URL")
    if not parts.hostname:
        raise UsageError(f"{where!r} names no host")
    if has_credentials:
        raise UsageError(f"{where!r}: a user or password in the URL is not supported")
    path = parts.path if parts.path not in ("", "/") else DEFAULT_PATH
    return urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


def fetch_text(url: str, timeout_ms: int) -> str:
    """The body of ``GET url`` as text (``url`` as :func:`metrics_url` returns it)."""
    where = redact_url(url)
    request = urllib.request.Request(
        url, headers={"Accept": ACCEPT, "User-Agent": "kvoffload-inspect"}
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=timeout_ms / 1000) as response:
            body: bytes = response.read(MAX_BYTES + 1)
    except urllib.error.HTTPError as exc:
        raise UsageError(f"metrics at {where}: HTTP {exc.code} {exc.reason}") from None
    except urllib.error.URLError as exc:
        raise UsageError(f"metrics at {where}: {_reason(exc.reason, timeout_ms)}") from None
    except (OSError, http.client.HTTPException, ValueError) as exc:
        raise UsageError(f"metrics at {where}: {_reason(exc, timeout_ms)}") from None
    if len(body) > MAX_BYTES:
        raise UsageError(f"metrics at {where}: the answer is over {MAX_BYTES >> 20} MiB")
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError(
            f"metrics at {where}: not Prometheus text exposition (not UTF-8)"
        ) from None


def inspect_metrics(url: str, timeout_ms: int) -> HealthReport:
    """One scrape of ``url`` (completed by :func:`metrics_url`) as a health report."""
    full = metrics_url(url)
    where = redact_url(full)
    text = fetch_text(full, timeout_ms)
    try:
        exposition = parse_exposition(text)
    except ExpositionError as exc:
        raise UsageError(f"metrics at {where}: not Prometheus text exposition: {exc}") from None
    if not has_kvoffload_metrics(exposition):
        raise UsageError(
            f"metrics at {where}: no kvoffload metrics (is this kvoffload's metrics_port "
            "endpoint, or vLLM's /metrics with kvoffload's connector?)"
        )
    try:
        return tier_health(exposition, where)
    except ValueError as exc:
        raise UsageError(f"metrics at {where}: {exc}") from None


def _reason(exc: object, timeout_ms: int) -> str:
    if isinstance(exc, TimeoutError):
        return f"no answer within {timeout_ms} ms"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    text = " ".join(str(exc).split())
    return text or type(exc).__name__
