"""`ftjob-trainer train` configuration: flags override the operator's env vars; bad values say what to fix."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from ftjob import contract
from ftjob.gpt.config import add_train_flags, from_args


def _cfg(argv: list[str], env: dict[str, str]):
    p = argparse.ArgumentParser()
    add_train_flags(p)
    return from_args(p.parse_args(argv), env)


ENV = {
    contract.ENV_REPLICA_GROUP: "2",
    contract.ENV_LIGHTHOUSE_URL: "http://10.0.0.5:29510",
    contract.ENV_TOKEN: "secret",
    contract.ENV_MIN_REPLICAS: "2",
    contract.ENV_ADVERTISE_ADDR: "10.0.0.9",
    contract.ENV_CHECKPOINT_DIR: "/ckpt",
    contract.ENV_COLLECTIVE_TIMEOUT_S: "7.5",
    contract.ENV_RANK: "1",
    contract.ENV_WORLD_SIZE: "2",
    contract.ENV_MASTER_PORT: "29555",
}


def test_env_is_used_when_no_flag_is_given() -> None:
    cfg = _cfg([], ENV)
    assert (cfg.group, cfg.lighthouse_url, cfg.token, cfg.min_replicas) == ("2", "http://10.0.0.5:29510", "secret", 2)
    assert (cfg.advertise_addr, cfg.checkpoint_dir, cfg.collective_timeout_s) == ("10.0.0.9", Path("/ckpt"), 7.5)
    assert (cfg.rank, cfg.world_size, cfg.master_port) == (1, 2, 29555)


def test_flags_override_env() -> None:
    cfg = _cfg(
        ["--group=5", "--token=t2", "--min-replicas=1", "--checkpoint-dir=/other", "--collective-timeout=2"], ENV
    )
    assert (cfg.group, cfg.token, cfg.min_replicas, cfg.checkpoint_dir, cfg.collective_timeout_s) == (
        "5",
        "t2",
        1,
        Path("/other"),
        2.0,
    )


def test_token_file_is_read(tmp_path: Path) -> None:
    f = tmp_path / "token"
    f.write_text("from-file\n")
    assert _cfg([], {contract.ENV_TOKEN_FILE: str(f)}).token == "from-file"


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--steps=0"], {}, "--steps must be >= 1"),
        (["--batch-size=3"], {contract.ENV_WORLD_SIZE: "2"}, "multiple of the group's ranks"),
        (["--checkpoint-every=5"], {}, "--checkpoint-every needs --checkpoint-dir"),
        ([], {contract.ENV_COLLECTIVE_TIMEOUT_S: "soon"}, "FTJOB_COLLECTIVE_TIMEOUT_S='soon' is not a number"),
        ([], {contract.ENV_RANK: "zero"}, "must be integers"),
    ],
)
def test_bad_values_say_what_to_fix(argv: list[str], env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _cfg(argv, env)
