"""Argument types of ``kvoffload inspect`` shared by its subcommands (the tiers' own
included, ``TierSpec.inspect``): each returns the parsed value or raises
``argparse.ArgumentTypeError`` naming the text."""

from __future__ import annotations

import argparse

from kvoffload.inspection.model import is_digest_hex


def namespace_hex(text: str) -> str:
    """A namespace digest: 32 hex digits (any case), lower-cased."""
    value = text.lower()
    if not is_digest_hex(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a namespace digest (32 hex digits)")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value
