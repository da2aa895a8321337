"""``python -m kvoffload``: the ``kvoffload`` command (:func:`kvoffload.cli.main`)."""

from __future__ import annotations

import sys

from kvoffload.cli import main

if __name__ == "__main__":
    sys.exit(main())
