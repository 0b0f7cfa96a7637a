"""docs/reference/python-api.md: one mkdocstrings directive per public name of ftjob.ft (its ``__all__``).

``__all__`` is read from the package's source, as mkdocstrings reads everything else on the page: no code of ftjob.ft
runs for it. mkdocstrings renders each name from the docstrings of the module that defines it.
"""

from __future__ import annotations

import ast
import importlib.util

from ftjob_docs import GENERATED_NOTE

PACKAGE = "ftjob.ft"
# The package's own docstring (the ten-line diff) heads the page; its names follow one by one.
PACKAGE_OPTIONS = """    options:
      members: false
      show_root_heading: false
      show_root_toc_entry: false
"""


def public_names(package: str = PACKAGE) -> list[str]:
    """The package's ``__all__``, in its order, as its ``__init__.py`` spells it."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise RuntimeError(f"{package} is not installed")
    with open(spec.origin, encoding="utf-8") as f:
        tree = ast.parse(f.read(), spec.origin)
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return [ast.literal_eval(element) for element in node.value.elts]  # type: ignore[attr-defined]
    raise RuntimeError(f"{package} has no __all__")


def render() -> str:
    """The page's Markdown."""
    out = [
        f"# Python API: `{PACKAGE}`\n",
        GENERATED_NOTE.format(source=f"the docstrings of `{PACKAGE}` and the modules its names come from"),
        f"Everything below is importable from `{PACKAGE}` itself (`import ftjob.ft as ft`); each name loads its "
        "module on first use.\n",
        f"::: {PACKAGE}\n{PACKAGE_OPTIONS}",
    ]
    out += [f"::: {PACKAGE}.{name}\n" for name in public_names()]
    return "\n".join(out)
