"""``ftjob-trainer``: the in-pod entry point.

ftjob-trainer lighthouse [...]   the job's quorum server (ftjob.lighthouse)
ftjob-trainer train [...]        one rank of one replica group (flags override the operator's env vars)
ftjob-trainer launch [...] [-- COMMAND...]
                                 a whole job as local processes running COMMAND (default: the reference trainer),
                                 with fault injection and a report
ftjob-trainer supervise [--ranks N] -- COMMAND...
                                 a pod's N rank processes of COMMAND, one per GPU (ftjob.launch.supervisor)
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``ftjob-trainer`` with its subcommands; ``lighthouse`` and ``supervise`` are only named here (their
    own parsers take their arguments: ftjob.lighthouse.cli, ftjob.launch.supervisor.build_parser)."""
    from ftjob.gpt.config import add_train_flags
    from ftjob.launch.config import add_launch_flags

    parser = argparse.ArgumentParser(
        prog="ftjob-trainer", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("lighthouse", help="run the job's lighthouse (see `ftjob-trainer lighthouse --help`)")
    train_p = sub.add_parser("train", help="train as one rank of one replica group")
    launch_p = sub.add_parser("launch", help="run lighthouse + groups locally, inject faults, report")
    sub.add_parser("supervise", help="run a pod's ranks (see `ftjob-trainer supervise --help`)")
    add_train_flags(train_p)
    add_launch_flags(launch_p)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The ``ftjob-trainer`` command: ``train``, ``launch``, ``lighthouse`` or ``supervise``; returns the exit code
    (2: invalid arguments)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "lighthouse":
        from ftjob.lighthouse.cli import main as lighthouse_main

        return int(lighthouse_main(argv[1:]) or 0)
    if argv and argv[0] == "supervise":  # PID 1 of a pod: dispatched before anything imports torch
        from ftjob.launch.supervisor import main as supervise_main

        return supervise_main(argv[1:])

    from ftjob.launch.config import split_command

    parser = build_parser()
    argv, command = split_command(argv) if argv and argv[0] == "launch" else (argv, [])
    args = parser.parse_args(argv)
    try:
        if args.command == "train":
            from ftjob.gpt import train
            from ftjob.gpt.config import from_args

            return train.main(from_args(args))
        from ftjob.launch import launcher

        return launcher.main(args, command)
    except ValueError as e:
        print(f"ftjob-trainer {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
