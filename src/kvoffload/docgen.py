"""Generated sections of the documentation, so they cannot drift from the code.

``docs/usage.md`` holds blocks between markers::

    <!-- generated:config -->
    ...
    <!-- end generated:config -->

``config`` is the table of :data:`kvoffload.core.config.typed.OPTIONS`, ``metrics`` the
table of :data:`kvoffload.core.observe.metrics.METRICS`. ``python -m kvoffload.docgen``
rewrites the blocks in place; ``--check`` exits 1 when a block is stale (a test
runs the same check).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path

from kvoffload.core.config.typed import OPTIONS
from kvoffload.core.observe.metrics import METRICS

USAGE = Path(__file__).resolve().parents[2] / "docs" / "usage.md"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def config_table() -> str:
    rows = ["| key | accepted values | default | meaning |", "|---|---|---|---|"]
    for option in OPTIONS:
        default = "required" if option.required else f"`{option.default!r}`"
        if option.default is None and not option.required:
            default = "unset"
        rows.append(
            f"| `{option.name}` | {_cell(option.accepted)} | {default} | {_cell(option.doc)} |"
        )
    return "\n".join(rows)


def metrics_table() -> str:
    rows = ["| metric | type | labels | meaning |", "|---|---|---|---|"]
    for m in METRICS:
        labels = ", ".join(f"`{label}`" for label in m.labels) or "none"
        rows.append(f"| `{m.full_name}` | {m.kind} | {labels} | {_cell(m.help)} |")
    return "\n".join(rows)


SECTIONS: dict[str, Callable[[], str]] = {"config": config_table, "metrics": metrics_table}


def _replacement(body: str) -> Callable[[re.Match[str]], str]:
    return lambda m: m.group(1) + body + "\n" + m.group(2)


def render(text: str) -> str:
    """``text`` with every generated block replaced by its current content."""
    for name, make in SECTIONS.items():
        pattern = re.compile(
            rf"(<!-- generated:{name} -->\n)(?:.*?\n)?(<!-- end generated:{name} -->)", re.S
        )
        if not pattern.search(text):
            raise ValueError(f"no generated:{name} block")
        text = pattern.sub(_replacement(make()), text)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvoffload.docgen", description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 if docs are stale")
    parser.add_argument("path", nargs="?", type=Path, default=USAGE)
    args = parser.parse_args(argv)
    text = args.path.read_text()
    fresh = render(text)
    if args.check:
        if fresh != text:
            print(f"{args.path}: generated sections are stale; run python -m kvoffload.docgen")
            return 1
        return 0
    args.path.write_text(fresh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
