"""`ftjob-trainer launch` flag validation: bad input fails before any process starts, saying what to fix."""

from __future__ import annotations

import argparse

import pytest
from ftjob.launch.config import add_launch_flags, config_from_args


def _cfg(*argv: str):
    p = argparse.ArgumentParser()
    add_launch_flags(p)
    return config_from_args(p.parse_args(list(argv)))


def test_defaults_fit_the_done_when_command() -> None:
    cfg = _cfg("--replicas=3", "--min-replicas=2", "--steps=200", "--kill-at=120,50")
    assert (cfg.replicas, cfg.min_replicas, cfg.steps, cfg.kill_at, cfg.model) == (3, 2, 200, [50, 120], "tiny")
    assert _cfg("--replicas=4").min_replicas == 3  # default: one group may be down


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--kill-at=50,abc"], "must be comma-separated step numbers"),
        (["--steps=100", "--kill-at=100"], "between 1 and --steps-1"),
        (["--replicas=2", "--min-replicas=3"], "between 1 and --replicas"),
        (["--replicas=2", "--min-replicas=2", "--kill-at=5"], "nothing could commit while a group is down"),
        (["--pods-per-replica=3", "--batch-size=8"], "multiple of --pods-per-replica"),
        (["--kill-every=0"], "--kill-every must be a positive"),
    ],
)
def test_bad_flags_say_what_to_fix(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _cfg(*argv)
