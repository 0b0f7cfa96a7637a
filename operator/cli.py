"""ftjob-operator entry point (placeholder until the operator lands)."""

import argparse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ftjob-operator", description="The ftjob Kubernetes operator.")
    parser.parse_args(argv)
    return 0
