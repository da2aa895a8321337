"""A lower tier is named in code only in its own module, the test support, inspect's
scanners, and at most a few other source files (``tiers/registry.py`` is the one
list of tiers; everything else reads the specs, decision 0015).

Counted with ``ast``: identifiers, attribute and argument names, imported names and
string constants; comments and docstrings are prose and not counted."""

from __future__ import annotations

import ast
import pathlib
from collections.abc import Iterator

import pytest

from kvoffload.tiers.registry import lower_tier_names

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "src" / "kvoffload"
EXEMPT = ("tiers", "inspection", "testing")  # the tiers' own modules and their support
MOST = 3  # other source files that may name one tier


def _docstrings(tree: ast.AST) -> set[int]:
    found: set[int] = set()
    for node in ast.walk(tree):
        holders = (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
        if isinstance(node, holders) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def names_in_code(source: str) -> Iterator[str]:
    """Every identifier and string constant of ``source`` (no comment, no docstring)."""
    tree = ast.parse(source)
    docstrings = _docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) not in docstrings:
                yield node.value
        elif isinstance(node, ast.Name):
            yield node.id
        elif isinstance(node, ast.Attribute):
            yield node.attr
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            yield node.name
        elif isinstance(node, ast.arg | ast.keyword) and node.arg:
            yield node.arg
        elif isinstance(node, ast.alias):
            yield node.name
            if node.asname:
                yield node.asname
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module


def files_naming(tier: str) -> list[str]:
    """The source files outside :data:`EXEMPT` whose code names ``tier``."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if relative.parts[0] in EXEMPT:
            continue
        if any(tier in name.lower() for name in names_in_code(path.read_text())):
            found.append(str(relative))
    return found


def test_the_counter_sees_code_and_skips_prose() -> None:
    source = '''"""About the disk."""
# the disk, again
import kvoffload.tiers.disk_tier as spec
def f(x: int) -> str:
    """Reads the disk."""
    return "plain"
'''
    assert [n for n in names_in_code(source) if "disk" in n] == ["kvoffload.tiers.disk_tier"]
    assert not any("disk" in n for n in names_in_code('"""disk"""\nx = 1\n'))
    assert any("disk" in n for n in names_in_code('x = "disk"\n'))
    assert any("disk" in n for n in names_in_code("disk_path = 1\n"))


@pytest.mark.parametrize("tier", lower_tier_names())
def test_few_source_files_outside_the_tiers_name_a_tier(tier: str) -> None:
    files = files_naming(tier)
    assert len(files) <= MOST, files
