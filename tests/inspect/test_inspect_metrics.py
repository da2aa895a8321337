"""``kvoffload inspect metrics`` against kvoffload's own Prometheus endpoint (the
``metrics_port`` exporter over a MetricsRecorder with host, disk and redis tiers),
against a vLLM-like exposition, and its one-line errors: a refused connection, a
silent server, text that is not an exposition, an HTTP error, bad URLs; the parser's
corner cases."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from kvoffload import cli
from kvoffload.core.directory.directory import DIRECTORY_COUNTERS
from kvoffload.core.errors import UsageError
from kvoffload.core.observe.metrics import labels
from kvoffload.core.observe.metrics_view import MetricsReading
from kvoffload.core.observe.recorder import CounterScope, MetricsRecorder
from kvoffload.core.scheduler_types import SCHEDULER_SERIES
from kvoffload.core.tiering.lower import declare_tier_counters
from kvoffload.inspect_command import main
from kvoffload.inspection.exposition import ExpositionError, Sample, parse_exposition
from kvoffload.testing.redis_server import free_port

pytest.importorskip("prometheus_client")
from kvoffload.adapters.prometheus import MetricsEndpoint

MIB = 1 << 20


def recorder() -> MetricsRecorder:
    """The series a scheduler half with host memory, a disk and a Redis tier exports
    from the start (as its parts declare them), then some traffic."""
    r = MetricsRecorder()
    r.declare_all(SCHEDULER_SERIES)
    for tier in ("host", "disk"):
        for name in DIRECTORY_COUNTERS:
            r.declare(name, tier=tier)
    for tier in ("disk", "redis"):
        declare_tier_counters(CounterScope(r, tier=tier))
    r.declare("evicted_without_copy_total", tier="host")
    host, disk, redis = (CounterScope(r, tier=t) for t in ("host", "disk", "redis"))
    r.count("lookups_total", 120, tier="host")
    r.count("hit_tokens_total", 40960, tier="host")
    r.count("transferred_chunks_total", 64, direction="store", tier="host")
    r.count("transferred_chunks_total", 30, direction="load", tier="host")
    r.count("failed_chunks_total", 1, direction="store", tier="host")
    host.count("evictions_total", 40)
    host.count("evicted_without_copy_total", 3)
    host.count("no_room_total", 2)
    disk.count("lookups_total", 40)
    disk.count("hit_tokens_total", 8192)
    disk.count("transferred_chunks_total", 60, direction="spill")
    disk.count("transferred_chunks_total", 10, direction="promote")
    disk.count("transferred_chunks_total", 4, direction="load")
    disk.count("failed_chunks_total", 2, direction="spill")
    disk.count("evictions_total", 5)
    disk.count("no_room_total", 1)
    disk.count("integrity_errors_total", reason="checksum")
    disk.count("integrity_errors_total", 2, reason="key")
    redis.count("lookups_total", 12)
    redis.count("hit_tokens_total", 2048)
    redis.count("transferred_chunks_total", 58, direction="spill")
    redis.count("transferred_chunks_total", 2, direction="promote")
    redis.count("failed_chunks_total", direction="promote")
    redis.count("missing_chunks_total", 3)
    r.count("deferrals_total", 4, reason="transfer_in_flight")
    r.count("deferrals_total", 3, reason="promotion")
    r.count("deferral_timeouts_total")
    r.observe_transfer("load", "host", 4 * MIB, 0.01)
    return r


GAUGES = {
    ("usage_bytes", labels(tier="host")): float(MIB),
    ("capacity_bytes", labels(tier="host")): float(4 * MIB),
    ("usage_bytes", labels(tier="disk")): float(3 * MIB),
    ("capacity_bytes", labels(tier="disk")): float(64 * MIB),
    ("usage_bytes", labels(tier="redis")): float(2 * MIB),
    ("codec_ratio", labels(tier="host")): 1.0,
    ("codec_ratio", labels(tier="disk")): 3.996,
    ("codec_ratio", labels(tier="redis")): 1.4521,
    ("jobs_in_flight", ()): 0.0,
}


@pytest.fixture
def endpoint() -> Iterator[str]:
    """kvoffload's exporter on a loopback port; its base URL (no path)."""
    r = recorder()

    def read() -> MetricsReading:
        counters = {series: float(n) for series, n in r.counters.items()}
        return MetricsReading(counters, dict(GAUGES), dict(r.histograms))

    served = MetricsEndpoint(read, 0)
    try:
        yield f"http://127.0.0.1:{served.port}"
    finally:
        served.close()


def table(text: str) -> dict[str, list[str]]:
    """The table's rows by their first cell (``used``/``capacity`` cells keep units)."""
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("COUNTER"))
    rows = {}
    for line in lines[head:]:
        if not line:
            break
        label, _, cells = line.partition("  ")
        rows[label.strip()] = cells.replace(" MiB", "MiB").split()
    return rows


def test_the_table_of_a_three_tier_engine(
    endpoint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["metrics", endpoint]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"kvoffload metrics at {endpoint}/metrics\n")
    rows = table(out)
    assert rows["COUNTER"] == ["host", "disk", "redis"]
    assert rows["lookups"] == ["120", "40", "12"]
    assert rows["hit tokens"] == ["40960", "8192", "2048"]
    assert rows["stored"] == ["64", "-", "-"]
    assert rows["spilled"] == ["-", "60", "58"]
    assert rows["promoted"] == ["-", "10", "2"]
    assert rows["loaded"] == ["30", "4", "0"]
    assert rows["failed"] == ["1", "2", "1"]
    assert rows["evictions"] == ["40", "5", "-"]  # Redis evicts on its own, uncounted
    assert rows["no room"] == ["2", "1", "0"]
    assert rows["integrity errors"] == ["-", "3", "-"]
    assert rows["missing chunks"] == ["-", "0", "3"]
    assert rows["used"] == ["1.0MiB", "3.0MiB", "2.0MiB"]
    assert rows["capacity"] == ["4.0MiB", "64.0MiB", "-"]
    assert rows["codec ratio"] == ["1.00x", "4.00x", "1.45x"]
    notes = out.split("\n\n", 2)[2].splitlines()
    assert notes == [
        "failed chunks by direction: host store=1; disk spill=2; redis promote=1",
        "integrity errors by reason: disk checksum=1 key=2",
        "host evictions without a lower-tier copy: 3 (7.5% of 40 host evictions)",
        "deferrals: 7 (promotion=3 transfer_in_flight=4); timed out: 1",
        "internal errors: 0",
    ]


def test_the_json_document(endpoint: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["metrics", endpoint, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["location"] == f"{endpoint}/metrics"
    host, disk, redis = doc["tiers"]
    assert host == {
        "tier": "host",
        "lookups": 120,
        "hit_tokens": 40960,
        "transferred": {"store": 64, "load": 30},
        "failed": {"store": 1, "load": 0},
        "evictions": 40,
        "no_room": 2,
        "integrity_errors": {},
        "missing_chunks": None,
        "usage_bytes": MIB,
        "capacity_bytes": 4 * MIB,
        "evicted_without_copy": 3,
        "evicted_without_copy_share": 0.075,
        "codec_ratio": 1.0,
    }
    assert disk["tier"] == "disk"
    assert disk["transferred"] == {"spill": 60, "promote": 10, "load": 4}
    assert disk["failed"] == {"spill": 2, "promote": 0, "load": 0}
    assert disk["integrity_errors"] == {"checksum": 1, "key": 2}
    assert (disk["evictions"], disk["no_room"], disk["missing_chunks"]) == (5, 1, 0)
    assert (disk["evicted_without_copy"], disk["evicted_without_copy_share"]) == (None, None)
    assert redis["tier"] == "redis"
    assert (redis["lookups"], redis["hit_tokens"], redis["missing_chunks"]) == (12, 2048, 3)
    assert (redis["evictions"], redis["capacity_bytes"]) == (None, None)
    assert redis["failed"] == {"spill": 0, "promote": 1, "load": 0}
    assert (disk["codec_ratio"], redis["codec_ratio"]) == (3.996, 1.4521)
    assert doc["deferrals"] == {"promotion": 3, "transfer_in_flight": 4}
    assert (doc["deferral_timeouts"], doc["internal_errors"]) == (1, 0)


def test_url_forms(endpoint: str, capsys: pytest.CaptureFixture[str]) -> None:
    """No scheme: http://; no path or ``/``: /metrics."""
    bare = endpoint.removeprefix("http://")
    for url in (endpoint, f"{endpoint}/", f"{endpoint}/metrics", bare, f" {bare}/ "):
        assert main(["metrics", url, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["location"] == f"{endpoint}/metrics"


def test_host_memory_alone_has_no_line_for_evictions_without_a_copy(
    capsys: pytest.CaptureFixture[str],
) -> None:
    r = MetricsRecorder()
    r.declare_all(SCHEDULER_SERIES)
    for name in DIRECTORY_COUNTERS:
        r.declare(name, tier="host")
    r.count("evictions_total", 5, tier="host")
    served = MetricsEndpoint(
        lambda: MetricsReading({k: float(n) for k, n in r.counters.items()}), 0
    )
    try:
        assert main(["metrics", f"127.0.0.1:{served.port}"]) == 0
    finally:
        served.close()
    out = capsys.readouterr().out
    assert table(out)["COUNTER"] == ["host"] and table(out)["evictions"] == ["5"]
    assert "without a lower-tier copy" not in out
    assert "deferrals: 0; timed out: 0" in out


# ------------------------------------------------------- a vLLM-like /metrics, by hand

VLLM_TEXT = r"""# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 1.0
# HELP kvoffload_lookups_total Prefix lookups answered, per tier.
# TYPE kvoffload_lookups_total counter
kvoffload_lookups_total{engine="0",model_name="m \"q\" \\ x",tier="host"} 5.0
kvoffload_lookups_total{engine="1",model_name="m \"q\" \\ x",tier="host"} 7.0
kvoffload_lookups_created{engine="0",model_name="m",tier="host"} 1.7e9
kvoffload_lookups_total{engine="0",model_name="m",tier="disk"} 2.0
kvoffload_evictions_total{engine="0",model_name="m",tier="host"} 8.0
kvoffload_integrity_errors_total{engine="0",model_name="m",reason="checksum",tier="disk"} 1.0
kvoffload_internal_errors_total{engine="1",model_name="m"} 1.0
"""


@contextmanager
def http_server(body: bytes, status: int = 200) -> Iterator[str]:
    """A loopback HTTP server answering every GET with ``status`` and ``body``."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_engines_are_summed_and_other_metrics_ignored(capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM's labels (engine, model_name) are summed over; a series that never moved is
    absent there (``-``), except evictions without a copy (0: a lower tier is there)."""
    with http_server(VLLM_TEXT.encode()) as url:
        assert main(["metrics", url, "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert main(["metrics", url]) == 0
        out = capsys.readouterr().out
    host, disk = doc["tiers"]
    assert (host["lookups"], host["evictions"], disk["lookups"]) == (12, 8, 2)
    assert (host["hit_tokens"], host["transferred"], disk["evictions"]) == (None, {}, None)
    assert (host["evicted_without_copy"], host["evicted_without_copy_share"]) == (0, 0.0)
    assert disk["integrity_errors"] == {"checksum": 1}
    assert (doc["deferrals"], doc["deferral_timeouts"], doc["internal_errors"]) == ({}, None, 1)
    assert table(out)["lookups"] == ["12", "2"] and table(out)["stored"] == ["-", "-"]
    assert "host evictions without a lower-tier copy: 0 (0.0% of 8 host evictions)" in out
    assert "deferrals: 0; timed out: -" in out
    assert "internal errors: 1 (offloading is off for the rest of the engine's life)" in out


# ------------------------------------------------------------------ one-line errors


def one_line_error(argv: list[str]) -> str:
    with pytest.raises(UsageError) as info:
        main(argv)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_a_refused_connection(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    message = one_line_error(["metrics", url])
    assert message == f"metrics at {url}/metrics: Connection refused"
    assert cli.main(["inspect", "metrics", url]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"kvoffload inspect: error: {message}\n" and captured.out == ""


def test_a_server_that_does_not_answer() -> None:
    with socket.socket() as listener:  # accepts connections (the backlog), never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        message = one_line_error(["metrics", url, "--timeout-ms", "200"])
    assert message == f"metrics at {url}/metrics: no answer within 200 ms"


@pytest.mark.parametrize(
    "body, needle",
    [
        (b"<!DOCTYPE html><html><body>It works</body></html>\n", "line 1: not a metric name"),
        (b'{"lookups": 3}', "line 1: not a metric name"),
        (b"# HELP x y\nkvoffload_lookups_total{tier=host} 1\n", "line 2: label tier's value"),
        (b"OK\n", "line 1: expected a value"),
        (b"kvoffload_lookups_total one\n", "'one' is not a number"),
        (b"\xff\xfe garbage", "not Prometheus text exposition (not UTF-8)"),
    ],
)
def test_text_that_is_not_an_exposition(body: bytes, needle: str) -> None:
    with http_server(body) as url:
        message = one_line_error(["metrics", url])
    assert message.startswith(f"metrics at {url}/metrics: not Prometheus text exposition")
    assert needle in message


def test_an_exposition_without_kvoffload_an_http_error_and_a_bad_count() -> None:
    with http_server(b"# TYPE up gauge\nup 1\n") as url:
        assert "no kvoffload metrics" in one_line_error(["metrics", url])
    with http_server(b"", status=404) as url:
        assert one_line_error(["metrics", url]) == f"metrics at {url}/metrics: HTTP 404 Not Found"
    with http_server(b'kvoffload_evictions_total{tier="host"} NaN\n') as url:
        assert "is nan, not a count" in one_line_error(["metrics", url])
    with http_server(b"") as url:
        assert "no kvoffload metrics" in one_line_error(["metrics", url])


@pytest.mark.parametrize(
    "url, needle",
    [
        ("ftp://127.0.0.1:1/metrics", "is not an http:// or https:// URL"),
        ("redis://127.0.0.1:6379", "is not an http:// or https:// URL"),
        ("http://127.0.0.1:abc", "is not a valid URL"),
        ("http://127.0.0.1:99999", "is not a valid URL"),
        ("http://:9464/metrics", "names no host"),
        ("http://admin:s3cret@127.0.0.1:1", "'http://admin:***@127.0.0.1:1': a user or"),
    ],
)
def test_bad_urls(url: str, needle: str) -> None:
    message = one_line_error(["metrics", url])
    assert needle in message and "s3cret" not in message


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["metrics", "--help"])
    assert info.value.code == 0
    assert "usage: kvoffload inspect metrics" in capsys.readouterr().out


# ------------------------------------------------------------------ the parser


def test_the_parser_reads_labels_escapes_timestamps_and_exemplars() -> None:
    text = (
        "\n  # a comment\n"
        "# TYPE a_total counter\n"
        "a_total 1\n"
        'b{x="1",y="q\\"uote",z="back\\\\slash\\nline",} 2.5 1700000000000\n'
        'c { x = "" } +Inf\n'
        "d NaN\n"
        'e_bucket{le="0.1"} 8 # {trace_id="abc"} 0.05 1.5\n'
        "# EOF\n"
    )
    exposition = parse_exposition(text)
    assert exposition.announced == {"a_total"}
    a, b, c, d, e = exposition.samples
    assert a == Sample("a_total", (), 1.0)
    assert b == Sample("b", (("x", "1"), ("y", 'q"uote'), ("z", "back\\slash\nline")), 2.5)
    assert c == Sample("c", (("x", ""),), float("inf"))
    assert d.name == "d" and d.value != d.value
    assert e == Sample("e_bucket", (("le", "0.1"),), 8.0)
    (crlf,) = parse_exposition('f{x="p\u2028q\rr"} 3\r\n').samples
    assert crlf == Sample("f", (("x", "p\u2028q\rr"),), 3.0)


@pytest.mark.parametrize(
    "line, problem",
    [
        ('a{x="1"', "expected ',' or '}' after a label"),
        ('a{x="1} 2', "a label value is not closed"),
        ('a{x="\\t"} 2', "bad escape in a label value"),
        ('a{x="1",x="2"} 2', "label x twice"),
        ('a{1x="1"} 2', "not a label name"),
        ('a{x "1"} 2', "no '=' after label x"),
        ("a 1 2 3", "expected a value and at most a timestamp after the name"),
        ("a 1_000", "'1_000' is not a number"),
        ("a-b 1", "not a metric name"),
        ("a 1 soon", "'soon' is not a number"),
    ],
)
def test_the_parser_refuses_malformed_lines(line: str, problem: str) -> None:
    with pytest.raises(ExpositionError) as info:
        parse_exposition(f"ok 1\n{line}\n")
    assert info.value.number == 2 and info.value.problem == problem
    assert str(info.value).startswith(f"line 2: {problem}: ")


def test_the_exporter_puts_each_label_value_under_its_own_label(endpoint: str) -> None:
    """``integrity_errors_total`` declares ``tier, reason`` while series are keyed by
    labels sorted by name: the exposition must still say tier="disk"."""
    import urllib.request

    with urllib.request.urlopen(f"{endpoint}/metrics", timeout=5) as response:
        text = response.read().decode()
    assert 'kvoffload_integrity_errors_total{reason="checksum",tier="disk"} 1.0' in text


def test_the_cost_model_s_lanes_and_declines(capsys: pytest.CaptureFixture[str]) -> None:
    """The load-or-recompute lines (decision 0013): the prefill speed, each lane the
    model decided on with its estimate, queue, verdict, declines by reason and probes."""
    r = recorder()
    r.count("hits_declined_total", 5, tier="disk", reason="transfer")
    r.count("hits_declined_total", 2, tier="disk", reason="queue")
    r.count("cost_probes_total", 3, tier="disk")
    gauges = {
        **GAUGES,
        ("cost_prefill_tokens_per_second", ()): 3200.0,
        ("cost_lane_loads", labels(tier="host")): 1.0,
        ("cost_lane_queued_chunks", labels(tier="host")): 0.0,
        ("cost_lane_latency_seconds", labels(tier="host")): 0.0001,
        ("cost_lane_seconds_per_chunk", labels(tier="host")): 0.0005,
        ("cost_lane_bytes_per_second", labels(tier="host")): float(4 * MIB) / 0.0005,
        ("cost_lane_loads", labels(tier="disk")): 0.0,
        ("cost_lane_queued_chunks", labels(tier="disk")): 8.0,
        ("cost_lane_latency_seconds", labels(tier="disk")): 0.002,
        ("cost_lane_seconds_per_chunk", labels(tier="disk")): 0.025,
        ("cost_lane_loads", labels(tier="redis")): 1.0,
        ("cost_lane_queued_chunks", labels(tier="redis")): 1.0,
        ("tier_load_seconds_per_chunk", labels(tier="host")): 0.0006,
        ("tier_hit_weight", labels(tier="host")): 0.96,
        ("tier_load_seconds_per_chunk", labels(tier="disk")): 0.027,
        ("tier_hit_weight", labels(tier="disk")): 0.0,
    }

    def read() -> MetricsReading:
        counters = {series: float(n) for series, n in r.counters.items()}
        return MetricsReading(counters, gauges, dict(r.histograms))

    served = MetricsEndpoint(read, 0)
    try:
        assert main(["metrics", f"http://127.0.0.1:{served.port}"]) == 0
    finally:
        served.close()
    out = capsys.readouterr().out.splitlines()
    at = out.index("load or recompute: prefill 3200 tokens/s")
    assert out[at + 1 : at + 8] == [
        "  host: loads (0.10 ms + 0.50 ms/chunk, 7.8 GiB/s; 0 chunks queued)",
        "  disk: recomputes (2.00 ms + 25.00 ms/chunk; 8 chunks queued); declined queue=2 "
        "transfer=5; probes 3",
        "  redis: loads (unmeasured; 1 chunks queued)",
        "hit weights for routers (prefill time a hit token saves; one-chunk load):",
        "  host: 0.60 ms/chunk, weight 0.96",
        "  disk: 27.00 ms/chunk, weight 0.00",
        "  redis: unmeasured",
    ]


def test_hit_weights_of_several_engines_are_their_mean(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """On vLLM's /metrics each engine has its own figures: a tier's is their mean (a
    weight summed over engines would pass 1); a tier only one engine measured shows
    that one's."""
    text = "\n".join(
        [
            'kvoffload_lookups_total{engine="0",tier="host"} 1.0',
            'kvoffload_lookups_total{engine="0",tier="disk"} 1.0',
            'kvoffload_tier_load_seconds_per_chunk{engine="0",tier="host"} 0.001',
            'kvoffload_tier_load_seconds_per_chunk{engine="1",tier="host"} 0.003',
            'kvoffload_tier_hit_weight{engine="0",tier="host"} 0.9',
            'kvoffload_tier_hit_weight{engine="1",tier="host"} 0.7',
            'kvoffload_tier_load_seconds_per_chunk{engine="1",tier="disk"} 0.012',
            'kvoffload_tier_hit_weight{engine="1",tier="disk"} 0.25',
            "",
        ]
    )
    with http_server(text.encode()) as url:
        assert main(["metrics", url, "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert main(["metrics", url]) == 0
        out = capsys.readouterr().out.splitlines()
    host, disk = doc["tier_costs"]
    assert host == {"tier": "host", "load_s_per_chunk": pytest.approx(0.002), "hit_weight": 0.8}
    assert disk == {"tier": "disk", "load_s_per_chunk": 0.012, "hit_weight": 0.25}
    at = out.index("load or recompute: prefill - tokens/s")
    assert out[at + 1 : at + 4] == [
        "hit weights for routers (prefill time a hit token saves; one-chunk load):",
        "  host: 2.00 ms/chunk, weight 0.80",
        "  disk: 12.00 ms/chunk, weight 0.25",
    ]
