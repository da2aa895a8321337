"""The fuzzer's codec draw (issue 33): which codec host memory keeps chunks in, and
which the seed's lower tier keeps them in, from a stream of the seed's own (every
seed keeps the rest of its draws as they were).

Most seeds keep ``none`` (the exact path every other check is built on); the rest
draw host memory's codec and the lower tier's, equal or not (a lower tier of another
codec re-encodes on spill and promotion, ``transfer/tier_codecs.py``). With ``fp8``
anywhere the harness's KV checks accept each value within e4m3's bound
(``vllm_harness/kv_model.py``: :func:`codec_tolerance`); otherwise they stay exact
(``lossless`` is bit-exact).
"""

from __future__ import annotations

import random
from typing import Any

from kvoffload.codecs import CODECS

CODEC_SHARE = 0.35
"""Share of seeds that draw codecs."""

NONE = ("none", "none")


def draw_codecs(seed: int) -> tuple[str, str]:
    """``(host memory's codec, the lower tier's)`` for ``seed``."""
    rng = random.Random(f"kvoffload-vllm-fuzz-codecs:{seed}")
    if rng.random() >= CODEC_SHARE:
        return NONE
    host = rng.choice(CODECS)
    lower = host if rng.random() < 0.5 else rng.choice(CODECS)
    return host, lower


def codec_options(codecs: tuple[str, str], lower_tier: str | None) -> dict[str, Any]:
    """kvoffload's options for ``codecs`` (the lower tier's only where there is one)."""
    host, lower = codecs
    options: dict[str, Any] = {} if host == "none" else {"codec": host}
    if lower_tier is not None and lower != host:
        options[f"{lower_tier}_codec"] = lower
    return options


def describe_codecs(codecs: tuple[str, str]) -> str:
    return "" if codecs == NONE else f" codecs=host:{codecs[0]},lower:{codecs[1]}"
