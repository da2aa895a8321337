"""``python -m kvoffload.gpucheck``: see :mod:`kvoffload.gpucheck.run`."""

import sys

from kvoffload.gpucheck.run import main

sys.exit(main())
