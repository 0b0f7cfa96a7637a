"""Every public class, function and method of ftjob.ft, of the operator's entry points and of the ftjob-trainer
command says what it is or does: a docstring, found by walking the sources' syntax trees (nothing is imported)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# ftjob.ft (all of it), the operator's entry points (ftjob.operator.runtime, `kubectl ftjob`) and ftjob.cli
SOURCES = (
    *sorted((ROOT / "trainer" / "ft").rglob("*.py")),
    *sorted((ROOT / "operator" / "runtime").glob("*.py")),
    ROOT / "operator" / "kubectl" / "cli.py",
    *sorted((ROOT / "trainer" / "cli").glob("*.py")),
)
Definition = ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef


def is_public(name: str) -> bool:
    return not name.startswith("_")


def is_accessor_or_overload(node: Definition) -> bool:
    """A property's setter or deleter (the getter carries the docstring), or a typing.overload stub."""
    for deco in node.decorator_list:
        if isinstance(deco, ast.Attribute) and deco.attr in ("setter", "deleter"):
            return True
        if isinstance(deco, ast.Name | ast.Attribute) and ast.unparse(deco).endswith("overload"):
            return True
    return False


def public_definitions(tree: ast.Module) -> Iterator[tuple[str, Definition]]:
    """(qualified name, node) of the module's public classes and functions, and of public classes' public methods."""
    for node in tree.body:
        if not isinstance(node, Definition) or not is_public(node.name) or is_accessor_or_overload(node):
            continue
        yield node.name, node
        if isinstance(node, ast.ClassDef):
            for member in node.body:
                if isinstance(member, Definition) and is_public(member.name) and not is_accessor_or_overload(member):
                    yield f"{node.name}.{member.name}", member


def missing_docstrings(path: Path) -> list[str]:
    """``path:line name`` of each public definition of the file that has no docstring."""
    if not is_public(path.stem) and path.name != "__init__.py":
        return []
    tree = ast.parse(path.read_text(), filename=str(path))
    where = path.relative_to(ROOT)
    return [f"{where}:{node.lineno} {name}" for name, node in public_definitions(tree) if not ast.get_docstring(node)]


def test_the_checked_sources_exist() -> None:
    assert len(SOURCES) > 20 and all(path.is_file() for path in SOURCES)


@pytest.mark.parametrize("path", SOURCES, ids=lambda path: str(path.relative_to(ROOT)))
def test_every_public_definition_has_a_docstring(path: Path) -> None:
    assert missing_docstrings(path) == []


def test_the_checker_finds_a_missing_docstring(tmp_path: Path) -> None:
    module = tmp_path / "sample.py"
    module.write_text(
        "class Shown:\n"
        '    """Has one."""\n'
        "    def method(self) -> None:\n"
        "        pass\n"
        "    def _private(self) -> None:\n"
        "        pass\n"
        "def function() -> None:\n"
        "    pass\n"
        "def _helper() -> None:\n"
        "    pass\n"
    )
    tree = ast.parse(module.read_text())
    missing = [name for name, node in public_definitions(tree) if not ast.get_docstring(node)]
    assert missing == ["Shown.method", "function"]
