"""The JSON document of a report: the Redis namespace keeps its former fields (the
always-zero ``temporary_*`` of the per-file disk layout), in their place, and adds
the namespace's ``record`` last."""

from __future__ import annotations

import json

from kvoffload.inspection.model import NamespaceReport, Report
from kvoffload.inspection.render import to_json


def namespace() -> NamespaceReport:
    return NamespaceReport(
        namespace="00" * 16,
        world_size=1,
        complete_chunks=1,
        incomplete_chunks=0,
        chunks_per_group={0: 1},
        shares_per_rank={0: 1},
        bytes=4160,
        format_versions={"1": 1},
        payload_bytes={4096: 1},
        vanished=0,
        verified=False,
        ok=0,
        bad={},
        bad_examples=[],
    )


def test_a_redis_namespace_keeps_the_fields_of_its_former_json() -> None:
    doc = json.loads(to_json(Report("redis", "redis://h:1/0", False, [namespace()])))
    assert list(doc["namespaces"][0]) == [
        "namespace",
        "world_size",
        "complete_chunks",
        "incomplete_chunks",
        "chunks_per_group",
        "shares_per_rank",
        "bytes",
        "format_versions",
        "payload_bytes",
        "temporary_files",
        "temporary_bytes",
        "vanished",
        "verified",
        "record",
        "shares",
    ]
    assert doc["namespaces"][0]["temporary_files"] == doc["namespaces"][0]["temporary_bytes"] == 0
