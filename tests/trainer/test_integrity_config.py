"""How the integrity settings reach a trainer: the launcher's flags and env (FTJOB_GENERATION per incarnation,
FTJOB_FAULT_INJECTION, FTJOB_DIGEST_EVERY) and the reference trainer's flags over the env contract."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
from ftjob import contract
from ftjob.gpt.config import add_train_flags, from_args
from ftjob.launch.config import add_launch_flags, config_from_args
from ftjob.launch.launcher import Launcher
from ftjob.launch.procs import start_group


def _launch_cfg(*argv: str):
    p = argparse.ArgumentParser()
    add_launch_flags(p)
    return config_from_args(p.parse_args(list(argv)))


def _train_cfg(env: dict[str, str], *argv: str):
    p = argparse.ArgumentParser()
    add_train_flags(p)
    return from_args(p.parse_args(list(argv)), env)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--inject-fault=group=1,kind=melt,step=3"], "kind must be nan, scale or bitflip"),
        (["--inject-fault=group=7,kind=nan,step=3"], "names group 7, not one of this run's groups"),
        (["--inject-fault=group=1,kind=nan"], "lacks"),
        (["--digest-every=-1"], "--digest-every must be >= 0"),
    ],
)
def test_bad_integrity_flags_say_what_to_fix(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _launch_cfg("--replicas=3", *argv)


def test_the_launcher_passes_the_fault_and_the_digest_interval_to_every_group(tmp_path: Path) -> None:
    spec = "group=2,kind=bitflip,step=15"
    cfg = _launch_cfg("--replicas=3", f"--run-dir={tmp_path}", f"--inject-fault={spec}", "--digest-every=5")
    env = Launcher(cfg).group_env
    assert env[contract.ENV_FAULT_INJECTION] == spec and env[contract.ENV_DIGEST_EVERY] == "5"
    assert contract.ENV_FAULT_INJECTION not in Launcher(_launch_cfg(f"--run-dir={tmp_path}")).group_env


def test_each_incarnation_of_a_group_learns_its_generation(tmp_path: Path) -> None:
    command = [sys.executable, "-c", f"import os; print('gen', os.environ[{contract.ENV_GENERATION!r}])"]
    for generation in (0, 1):
        gp = start_group("1", generation, 1, command, {}, tmp_path)
        for p in gp.procs:
            p.wait(60)
        gp.close_logs()
    logs = sorted(tmp_path.glob("group-1-gen*-rank0.log"))
    assert [p.read_text().strip() for p in logs] == ["gen 0", "gen 1"]


def test_the_reference_trainer_reads_the_integrity_env_and_its_flags_win() -> None:
    cfg = _train_cfg({})
    assert (cfg.gradient_guard, cfg.guard_norm_ratio, cfg.digest_every) == (True, 100.0, 100)
    env = {contract.ENV_GUARD: "0", contract.ENV_GUARD_NORM_RATIO: "3", contract.ENV_DIGEST_EVERY: "7"}
    cfg = _train_cfg(env)
    assert (cfg.gradient_guard, cfg.guard_norm_ratio, cfg.digest_every) == (False, 3.0, 7)
    cfg = _train_cfg(env, "--gradient-guard=on", "--guard-norm-ratio=20", "--digest-every=0")
    assert (cfg.gradient_guard, cfg.guard_norm_ratio, cfg.digest_every) == (True, 20.0, 0)
    with pytest.raises(ValueError, match="--guard-norm-ratio must be > 1"):
        _train_cfg({}, "--guard-norm-ratio=1")
    with pytest.raises(ValueError, match=f"{contract.ENV_DIGEST_EVERY}='often' is not a number"):
        _train_cfg({contract.ENV_DIGEST_EVERY: "often"})


def test_the_reference_trainer_reads_the_sketch_switch_and_its_flag_wins() -> None:
    assert _train_cfg({}).guard_sketch is False
    assert _train_cfg({contract.ENV_GUARD_SKETCH: "1"}).guard_sketch is True
    assert _train_cfg({contract.ENV_GUARD_SKETCH: "1"}, "--guard-sketch=off").guard_sketch is False
    assert _train_cfg({}, "--guard-sketch=on").guard_sketch is True
