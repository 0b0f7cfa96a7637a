"""ftjob-trainer entry point (placeholder until the trainer lands)."""

import argparse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ftjob-trainer", description="The ftjob in-pod trainer.")
    parser.parse_args(argv)
    return 0
