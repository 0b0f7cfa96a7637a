"""docs/reference/cli.md: the ``--help`` of every command ftjob installs, from the argparse parsers themselves.

Help is formatted at a fixed width and with every FTJOB_* variable unset, so the page shows the defaults a fresh
process has, never those of the machine that built the site.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ftjob_docs import GENERATED_NOTE

HELP_WIDTH = 100


@dataclass(frozen=True)
class Command:
    """One command line and its help text."""

    name: str  # e.g. "ftjob-trainer launch"
    help: str


@contextlib.contextmanager
def plain_environment() -> Iterator[None]:
    """No FTJOB_* variable and a fixed terminal width while parsers are built and their help formatted."""
    saved = dict(os.environ)
    for name in [n for n in os.environ if n.startswith("FTJOB_")]:
        del os.environ[name]
    os.environ["COLUMNS"] = str(HELP_WIDTH + 2)  # argparse wraps at COLUMNS - 2
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """A parser's subcommand parsers, by name, in the order they were added."""
    for action in parser._actions:  # argparse has no public way to reach its subparsers
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def help_of(build: Callable[[], argparse.ArgumentParser]) -> str:
    """The help text of the parser ``build`` makes."""
    return build().format_help()


def lighthouse_help() -> str:
    """``ftjob-trainer lighthouse --help``: its parser function when the module has one, else its own --help."""
    from ftjob.lighthouse import cli

    for name in ("build_parser", "parser"):
        build = getattr(cli, name, None)
        if callable(build):
            return help_of(build)
    # The module builds its parser inside parse_args(): ask it for --help as a user would.
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        cli.parse_args(["--help"])
    if not out.getvalue().strip():
        raise RuntimeError("ftjob.lighthouse.cli printed no help: the docs site cannot document it")
    return out.getvalue()


def commands() -> list[Command]:
    """Every command and subcommand, in the page's order."""
    from ftjob.cli import build_parser as trainer_parser
    from ftjob.launch.supervisor import build_parser as supervise_parser
    from ftjob.operator.kubectl.cli import parser as kubectl_parser
    from ftjob.operator.runtime.settings import parser as operator_parser

    with plain_environment():
        out = [Command("ftjob-operator", help_of(operator_parser))]
        trainer = trainer_parser()
        out.append(Command("ftjob-trainer", trainer.format_help()))
        own_parsers = {"lighthouse": lighthouse_help, "supervise": lambda: help_of(supervise_parser)}
        for name, sub in subcommands(trainer).items():
            out.append(
                Command(f"ftjob-trainer {name}", own_parsers[name]() if name in own_parsers else sub.format_help())
            )
        kubectl = kubectl_parser()
        out.append(Command("kubectl-ftjob", kubectl.format_help()))
        out += [Command(f"kubectl-ftjob {name}", sub.format_help()) for name, sub in subcommands(kubectl).items()]
    return out


def render() -> str:
    """The page's Markdown."""
    out = [
        "# Command-line reference\n",
        GENERATED_NOTE.format(source="the commands' argparse parsers"),
        "`kubectl-ftjob` is a kubectl plugin: once it is on `PATH`, `kubectl ftjob ...` runs it.\n",
    ]
    for command in commands():
        level = "##" if " " not in command.name else "###"
        out += [f"{level} `{command.name}`\n", "```text", command.help.rstrip(), "```\n"]
    return "\n".join(out)
