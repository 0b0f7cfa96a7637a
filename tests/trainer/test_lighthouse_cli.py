"""`ftjob-trainer lighthouse`'s settings: every flag falls back to its FTJOB_* variable, then to its default; a bad
value of either exits 2 naming the flag and the variable."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
from ftjob import contract
from ftjob.lighthouse.cli import SETTINGS, build_parser, parse_args

# A valid value of every setting, as text, and what it parses to. A new setting needs a row here.
SAMPLES: dict[str, tuple[str, Any]] = {
    "--bind": ("127.0.0.1:0", "127.0.0.1:0"),
    "--min-replicas": ("2", 2),
    "--replicas": ("3", 3),
    "--groups": ("4", 4),
    "--join-timeout": ("0.5", 0.5),
    "--heartbeat-timeout": ("7", 7.0),
    "--state-file": ("/var/lib/lh/state.json", "/var/lib/lh/state.json"),
    "--restore-quorum-id": ("11", 11),
    "--restore-step": ("12", 12),
    "--restore-window": ("30", 30.0),
    "--group-generations": ("0:2,1:3", {"0": 2, "1": 3}),
    "--guard-max-offences": ("5", 5),
    "--guard-window-s": ("90", 90.0),
    "--stall-factor": ("0", 0.0),
    "--stall-floor-s": ("2.5", 2.5),
    "--audit-file": ("AUDIT", "AUDIT"),  # replaced by a file under tmp_path: the lighthouse opens it
    "--token-file": ("/run/token", "/run/token"),
    "--operator-token-file": ("/run/operator-token", "/run/operator-token"),
    "--tls-cert": ("/tls/tls.crt", "/tls/tls.crt"),
    "--tls-key": ("/tls/tls.key", "/tls/tls.key"),
}
# Settings that are only valid together: the partner comes from the environment in each check.
PARTNERS = {
    "--tls-cert": (contract.ENV_TLS_KEY_FILE, "/tls/tls.key"),
    "--tls-key": (contract.ENV_TLS_CERT_FILE, "/tls/tls.crt"),
}
NUMERIC = [s for s in SETTINGS if isinstance(s.default, int | float) or s.flag in ("--replicas", "--groups")]


def sample(flag: str, tmp_path: Path) -> tuple[str, Any]:
    text, value = SAMPLES[flag]
    if flag == "--audit-file":
        path = str(tmp_path / "audit.jsonl")
        return path, path
    return text, value


def partner_env(flag: str) -> dict[str, str]:
    return dict([PARTNERS[flag]]) if flag in PARTNERS else {}


def test_every_setting_has_a_sample_and_a_help_naming_its_variable():
    assert {s.flag for s in SETTINGS} == set(SAMPLES)
    helps = {a.option_strings[0]: a.help or "" for a in build_parser()._actions if a.option_strings[0] != "-h"}
    assert set(helps) == set(SAMPLES), "build_parser has one flag per setting"
    for s in SETTINGS:
        assert f"(env {s.env}; default: " in helps[s.flag], s.flag


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: s.flag)
def test_a_flag_falls_back_to_its_variable_then_to_its_default(setting, tmp_path: Path):
    text, value = sample(setting.flag, tmp_path)
    env = {setting.env: text, **partner_env(setting.flag)}
    assert getattr(parse_args([], env), setting.dest) == value, "from the environment"
    env[setting.env] = "ignored: the flag wins"
    assert getattr(parse_args([setting.flag, text], env), setting.dest) == value, "the flag over the environment"
    for unset in ({}, {setting.env: ""}):  # an empty variable is unset (and a partner then goes unset too)
        assert getattr(parse_args([], unset), setting.dest) == setting.default


def test_the_process_environment_is_the_default_source(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(contract.ENV_MIN_REPLICAS, "4")
    assert parse_args([]).min_replicas == 4


def test_defaults_and_the_derived_host_and_port():
    args = parse_args([], {})
    assert (args.host, args.port) == ("0.0.0.0", contract.LIGHTHOUSE_PORT)
    assert (args.min_replicas, args.join_timeout, args.heartbeat_timeout, args.restore_window) == (1, 1.0, 5.0, 120)
    assert (args.replicas, args.groups, args.group_generations, args.tls_cert) == (None, None, {}, None)
    assert parse_args(["--bind", ":0"], {}).host == "0.0.0.0"


@pytest.mark.parametrize("setting", NUMERIC, ids=lambda s: s.flag)
def test_a_bad_number_exits_2_naming_the_flag_and_the_variable(setting, capsys: pytest.CaptureFixture[str]):
    kind = "int" if isinstance(SAMPLES[setting.flag][1], int) else "float"
    for argv, env in (([], {setting.env: "abc"}), ([setting.flag, "abc"], {})):
        with pytest.raises(SystemExit) as e:
            parse_args(argv, env)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert f"error: {setting.flag} (env {setting.env}): invalid {kind} value: 'abc'" in err, (argv, env)


@pytest.mark.parametrize(
    ("flag", "value", "problem"),
    [
        ("--min-replicas", "0", "must be an integer >= 1, got '0'"),
        ("--heartbeat-timeout", "0", "must be a number > 0, got '0'"),
        ("--join-timeout", "-1", "must be a number >= 0, got '-1'"),
        ("--restore-step", "-1", "must be an integer >= 0, got '-1'"),
        ("--bind", "localhost", "must be HOST:PORT"),
        ("--group-generations", "0=1", "'0=1' is not GROUP:GENERATION"),
    ],
)
def test_a_value_out_of_range_exits_2_from_a_flag_or_the_environment(flag, value, problem, capsys):
    setting = next(s for s in SETTINGS if s.flag == flag)
    for argv, env in (([], {setting.env: value}), ([f"{flag}={value}"], {})):
        with pytest.raises(SystemExit) as e:
            parse_args(argv, env)
        assert e.value.code == 2
        assert f"{flag} (env {setting.env}): {problem}" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["--tls-cert", "c"], "--tls-cert and --tls-key go together"),
        (["--replicas", "3", "--groups", "2"], "--groups must be >= --replicas"),
        (["--groups", "2", "--group-generations", "2:1"], "names group(s) ['2'] outside 0..1 (--groups)"),
    ],
)
def test_settings_that_must_agree(argv, problem, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(argv, {})
    assert e.value.code == 2 and problem in capsys.readouterr().err


def test_the_parser_alone_leaves_absent_flags_unset():
    # the reference page is generated from build_parser(); resolving the environment is parse_args' job
    args = build_parser().parse_args([])
    assert isinstance(args, argparse.Namespace) and all(getattr(args, s.dest) is None for s in SETTINGS)
