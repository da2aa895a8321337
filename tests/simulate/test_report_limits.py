"""The report's limit lines and the behind-the-trace criterion."""

from __future__ import annotations

import pytest

from kvoffload.simulate.optimum import Bounds
from kvoffload.simulate.report_limits import behind_warning, is_behind, limit_lines


@pytest.mark.parametrize(
    ("late", "span", "behind"),
    [
        (29.0, 100.0, False),  # under the 30 s floor
        (31.0, 100.0, True),
        (300.0, 3537.0, False),  # under a tenth of the span
        (400.0, 3537.0, True),
    ],
)
def test_behind_means_a_late_queue_over_30_s_and_a_tenth_of_the_span(
    late: float, span: float, behind: bool
) -> None:
    assert is_behind(late, span) is behind
    warning = behind_warning(late, span)
    assert (warning is not None) is behind
    if warning is not None:
        assert warning.startswith("WARNING: the simulated engine fell behind the trace")
        assert f"waited {late:.0f} s (median)" in warning


def test_limit_lines() -> None:
    b = Bounds(capacity_chunks=9139, optimum_tokens=400, infinite_tokens=500, prompt_tokens=1000)
    total, limit = limit_lines(200, 1000, b)
    assert "hit rate (engine + kvo)   20.0%  (200 prompt tokens served" in total
    assert limit.split()[1:] == [
        "optimum", "40.0%", "at", "9139", "chunks,", "infinite", "cache", "50.0%;",
        "this", "run", "reaches", "50.0%", "of", "the", "optimum",
    ]  # fmt: skip
    assert len(limit_lines(200, 1000, None)) == 1
    assert "above it" in limit_lines(450, 1000, b)[-1]
