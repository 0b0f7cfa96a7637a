"""A folder where ftjob's packages sit at their import paths (``ftjob/ft``, ``ftjob/contract``, ...), for griffe.

pyproject maps ``ftjob.ft`` to ``trainer/ft`` and so on (package-dir), and the editable install resolves that at
import time only; griffe, which mkdocstrings uses to read the sources without importing them, looks for folders named
like the packages. The folder holds one symbolic link per mapped package, so it is never out of date.
"""

from __future__ import annotations

import tempfile
import tomllib
from pathlib import Path

from ftjob_docs import REPO_ROOT


def package_dirs(root: Path = REPO_ROOT) -> dict[str, Path]:
    """pyproject's package-dir mapping: dotted package name -> its source folder."""
    with open(root / "pyproject.toml", "rb") as f:
        mapping = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    return {name: root / folder for name, folder in mapping.items()}


def make_python_path() -> Path:
    """A new temporary folder of links, one per mapped package at its import path; the caller removes it."""
    top = Path(tempfile.mkdtemp(prefix="ftjob-docs-python-path-"))
    for name, folder in package_dirs().items():
        link = top.joinpath(*name.split("."))
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(folder, target_is_directory=True)
    return top
