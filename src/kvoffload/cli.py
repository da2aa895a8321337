"""The ``kvoffload`` command."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvoffload", description="KV-cache offloading tools")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="replay a chat workload through the directory, per policy")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from kvoffload.demos.policies import run

        print(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
