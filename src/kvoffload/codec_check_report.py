"""What ``kvoffload codec-check`` reports (issues 33, 41): the model and the sample it
measured on (:class:`Sample`), and per codec the comparison of two passes' answers
(:class:`Report`, :func:`compare`), each stating what it measured and no more.

"Identical" means every generated token id of a request is the same in both passes:
the first pass computed the prompt's KV, the second loaded it from kvoffload. A
request whose answers differ is described by its first differing token (1-based, of
the tokens generated). Pure: no torch, no vLLM.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

DEMO_MARKER = "kvoffload-model.json"
"""The file ``kvoffload.demos.tiny_model`` writes last into a random-weight checkpoint."""


@dataclass(frozen=True)
class Answer:
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]


@dataclass(frozen=True)
class Sample:
    """The model and the sample a check measured on."""

    model: str  # the model's directory
    architecture: str  # from its config.json: class, layers, sizes
    random_weights: str | None  # a kvoffload demo checkpoint: which preset; else None
    dtype: str  # the engine's dtype (the KV cache's)
    prompts: int
    prompt_tokens: str  # "512 each", or the range of a prompt file's lengths
    source: str  # "random token ids (seed 0)" or the prompt file
    max_tokens: int  # generated per request, greedy

    def text(self) -> str:
        weights = (
            f"random weights ({self.random_weights})"
            if self.random_weights
            else "weights as found in the directory"
        )
        return "\n".join([
            f"model {self.model}: {self.architecture}; {weights}",
            f"sample: {self.prompts} prompts of {self.prompt_tokens} tokens ({self.source}), "
            f"{self.max_tokens} tokens generated greedily each, engine dtype {self.dtype}",
            "identical: all generated token ids of a request equal between the pass that "
            "computed the prompt's KV and the pass that loaded it from kvoffload",
        ])  # fmt: skip


def describe_model(directory: Path) -> tuple[str, str | None]:
    """A model directory's architecture as its ``config.json`` gives it, and, for a
    checkpoint ``kvoffload.demos.tiny_model`` wrote, its preset (random weights)."""
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return "no readable config.json", None
    if not isinstance(config, dict):
        return "a config.json that is not an object", None
    names = config.get("architectures") or [config.get("model_type", "unknown")]
    parts = [str(names[0])]
    for key, label in (
        ("num_hidden_layers", "layers"),
        ("hidden_size", "hidden"),
        ("num_key_value_heads", "KV heads"),
        ("vocab_size", "vocab"),
    ):
        if key in config:
            parts.append(f"{config[key]} {label}")
    preset = None
    try:
        marker = json.loads((directory / DEMO_MARKER).read_text())
        preset = f"kvoffload's demo preset {marker.get('name')!r}, seed {marker.get('seed')}"
    except (OSError, ValueError, AttributeError):
        pass
    return ", ".join(parts), preset


@dataclass(frozen=True)
class Report:
    codec: str
    requests: int
    identical_requests: int
    token_agreement: float
    mean_abs_logprob_delta: float
    max_abs_logprob_delta: float
    loaded_tokens: int
    max_tokens: int = 0
    first_differences: tuple[int, ...] = ()  # per differing request: 1-based position

    def text(self) -> str:
        lines = [
            f"codec {self.codec}: {self.loaded_tokens} prompt tokens loaded from kvoffload "
            "in the second pass",
            f"  identical answers: {self.identical_requests}/{self.requests}",
            f"  per-token agreement: {100 * self.token_agreement:.2f}%",
        ]
        if self.first_differences:
            d = self.first_differences
            lines.append(
                f"  first differing token, in the {len(d)} answers that differ: min {min(d)}, "
                f"median {statistics.median(d):g}, max {max(d)} (of {self.max_tokens})"
            )
        lines.append(
            f"  log-probability delta of the chosen tokens (before any difference): mean "
            f"{self.mean_abs_logprob_delta:.2e}, largest {self.max_abs_logprob_delta:.2e}"
        )
        return "\n".join(lines)


def compare(codec: str, before: list[Answer], after: list[Answer], loaded: int) -> Report:
    """The :class:`Report` of two passes' answers (same prompts, same order)."""
    same_requests, agree, total = 0, 0, 0
    deltas: list[float] = []
    first: list[int] = []
    longest = 0
    for a, b in zip(before, after, strict=True):
        same_requests += a.tokens == b.tokens
        n = max(len(a.tokens), len(b.tokens))
        longest = max(longest, n)
        agree += sum(x == y for x, y in zip(a.tokens, b.tokens, strict=False))
        total += n
        for x, y, lx, ly in zip(a.tokens, b.tokens, a.logprobs, b.logprobs, strict=False):
            if x != y:
                break
            deltas.append(abs(lx - ly))
        if a.tokens != b.tokens:
            first.append(_first_difference(a.tokens, b.tokens))
    return Report(
        codec=codec,
        requests=len(before),
        identical_requests=same_requests,
        token_agreement=agree / total if total else 1.0,
        mean_abs_logprob_delta=statistics.fmean(deltas) if deltas else 0.0,
        max_abs_logprob_delta=max(deltas, default=0.0),
        loaded_tokens=loaded,
        max_tokens=longest,
        first_differences=tuple(first),
    )


def _first_difference(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """The 1-based position of the first token where ``a`` and ``b`` differ (one
    ending first counts as differing just past its end)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i + 1
    return min(len(a), len(b)) + 1


CAVEAT = (
    "A measurement on this model, dtype and sample only: another model, dtype or set of "
    "prompts can give other figures. Compare the codec's line with the none line (the "
    "control: loading exact KV instead of computing it)."
)
RANDOM_CAVEAT = "These weights are random: the figures say nothing of a trained model's outputs."
