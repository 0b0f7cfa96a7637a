"""`ftjob-operator`: the command-line entry point."""

from __future__ import annotations

import asyncio
import logging
import sys

from ftjob.operator.runtime.settings import parse


def main(argv: list[str] | None = None) -> int:
    """The ``ftjob-operator`` command: parses the flags, sets up logging and runs the operator; returns the exit
    code."""
    settings = parse(argv)
    logging.basicConfig(
        level=logging.DEBUG if settings.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if not settings.verbose:
        for noisy in ("kopf.objects", "kopf.activities", "urllib3", "aiohttp.access"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
    from ftjob.operator.runtime.app import run  # imported late: --help stays fast

    return asyncio.run(run(settings))


if __name__ == "__main__":
    sys.exit(main())
