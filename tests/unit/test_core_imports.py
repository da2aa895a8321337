"""core/ must import neither torch nor vllm: statically and at run time."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

CORE = pathlib.Path(__file__).resolve().parents[2] / "src" / "kvoffload" / "core"
FORBIDDEN = {"torch", "vllm"}


def _imported_roots(path: pathlib.Path) -> set[str]:
    roots: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


def test_no_core_module_names_torch_or_vllm() -> None:
    files = sorted(CORE.rglob("*.py"))
    assert files, "core/ has no modules?"
    offenders = {str(f.relative_to(CORE)): _imported_roots(f) & FORBIDDEN for f in files}
    assert {f: r for f, r in offenders.items() if r} == {}


def test_importing_every_core_module_loads_neither_torch_nor_vllm() -> None:
    modules = [
        "kvoffload.core." + ".".join(f.relative_to(CORE).with_suffix("").parts)
        for f in sorted(CORE.rglob("*.py"))
        if f.name != "__init__.py"
    ]
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print(sorted(r for r in ('torch', 'vllm') if r in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
