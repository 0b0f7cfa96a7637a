"""MkDocs hook: adds the generated reference pages (docs/reference/*.md) to the site at build time.

Each page is rendered from the code it documents (hack/docs/ftjob_docs) and exists only in the build: nothing is
written into docs/. A renderer that raises fails the build, so a page can never silently go stale or incomplete.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

# Imported when MkDocs loads this hook: MkDocs puts this folder on sys.path only while it does.
from ftjob_docs import cli_page, crd_page, env_page, metrics_page, python_api_page
from ftjob_docs.python_path import make_python_path
from mkdocs.config.defaults import MkDocsConfig
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files

GENERATED_PAGES: dict[str, Callable[[], str]] = {
    "reference/crd.md": crd_page.render,
    "reference/metrics.md": metrics_page.render,
    "reference/env.md": env_page.render,
    "reference/python-api.md": python_api_page.render,
    "reference/cli.md": cli_page.render,
}
_python_paths: list[Path] = []  # made for this process's builds; removed when MkDocs shuts down


@event_priority(100)  # before mkdocstrings' own on_config, which makes its handlers from their configuration
def on_config(config: MkDocsConfig) -> MkDocsConfig:
    """Points mkdocstrings' Python handler at ftjob's packages (see ftjob_docs.python_path for why it needs that)."""
    _python_paths.append(make_python_path())
    handlers = config.plugins["mkdocstrings"].config.handlers
    python = handlers.setdefault("python", {})
    python["paths"] = [str(_python_paths[-1]), *python.get("paths", ())]
    return config


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Adds every generated page; a hand-written file of the same path is refused, never silently replaced."""
    for path, render in GENERATED_PAGES.items():
        if files.get_file_from_path(path) is not None:
            raise RuntimeError(f"docs/{path} is generated at build time: delete the file of that name in docs/")
        files.append(File.generated(config, path, content=render()))
    return files


def on_shutdown() -> None:
    """Removes the link folders this process made."""
    while _python_paths:
        shutil.rmtree(_python_paths.pop(), ignore_errors=True)
