"""``kvoffload seal-key``: make, rotate and show a seal key file (decision 0024).

- ``new PATH``: a key file with one fresh key (32 bytes from ``os.urandom``), created
  exclusively, mode 0600; refused if PATH exists.
- ``rotate PATH [--keep N]``: a fresh key first, the N newest old keys after it
  (default 2), written atomically. Restart the engines with it, newest first: every
  engine opens what either key sealed; drop the old key once nothing sealed under it
  is wanted any more (its chunks become misses).
- ``show PATH``: the key ids, the first being the one that seals (never the keys).

Exit status 0, or 2 with one line on stderr for a file that is missing, unsafe or not
a key file (``kvoffload``'s command runner prints the :class:`ConfigError`).
"""

from __future__ import annotations

import argparse

from kvoffload.sealing import keyfile


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="kvoffload seal-key",
        description="Make, rotate or show a seal key file (seal_key_file).",
    )
    sub = parser.add_subparsers(dest="action", required=True)
    new = sub.add_parser("new", help="create a key file with one fresh key (mode 0600)")
    new.add_argument("path", metavar="PATH")
    rotate = sub.add_parser("rotate", help="put a fresh key first, keep older ones to open")
    rotate.add_argument("path", metavar="PATH")
    rotate.add_argument(
        "--keep", type=int, default=2, metavar="N", help="old keys kept after it (default 2)"
    )
    show = sub.add_parser("show", help="the key ids (the first seals)")
    show.add_argument("path", metavar="PATH")
    args = parser.parse_args(argv)
    if args.action == "new":
        keys = keyfile.write_new(args.path)
    elif args.action == "rotate":
        keys = keyfile.rotate(args.path, args.keep)
    else:
        keys = keyfile.load(args.path)
    print(f"{args.path}: seals with key {keys.ids()[0]}", end="")
    print(f"; also opens {', '.join(keys.ids()[1:])}" if len(keys.keys) > 1 else "")
    return 0
