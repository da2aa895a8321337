"""The ``kvoffload`` command."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvoffload", description="KV-cache offloading tools")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "demo",
        help="multi-turn chat on a real vLLM engine, without and with kvoffload",
        add_help=False,
    )
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        from kvoffload.demos.chat_demo import main as demo_main

        return demo_main(rest)
    parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
