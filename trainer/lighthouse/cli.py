"""``ftjob-trainer lighthouse``: the per-job quorum service (see quorum for the rule, server for
the API). Flags override the FTJOB_* environment variables the operator sets; SETTINGS lists both."""

from __future__ import annotations

import argparse
import asyncio
import copy
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from ftjob import contract
from ftjob.contract.tls import server_context
from ftjob.lighthouse.api.auth import Credentials
from ftjob.lighthouse.api.http_errors import JsonErrorRunner
from ftjob.lighthouse.api.server import LighthouseServer
from ftjob.lighthouse.audit_trail import configure_audit_logging
from ftjob.lighthouse.core.integrity_checks import DEFAULT_MAX_OFFENCES, DEFAULT_WINDOW_S, IntegrityChecks
from ftjob.lighthouse.core.quorum import QuorumCore
from ftjob.lighthouse.core.stall import DEFAULT_FACTOR, DEFAULT_FLOOR_S, StallRule
from ftjob.lighthouse.core.state import load_state
from ftjob.lighthouse.gc_pacing import GcPacer

log = logging.getLogger("ftjob.lighthouse")
SHUTDOWN_GRACE_S = 1.0
# Connections the kernel queues for accept(): every group connects at once when a job starts or a replacement
# lighthouse comes up. aiohttp's default (128) overflowed while 12,500 groups connected to a lighthouse whose loop was
# busy (their SYNs reset, each group backing off to retry); the kernel caps it at net.core.somaxconn.
LISTEN_BACKLOG = 16_384


@dataclass(frozen=True)
class Setting:
    """One setting of the lighthouse: its flag, the environment variable it falls back to (the operator sets them),
    the function that parses either one's text, and the default when neither is given."""

    flag: str
    env: str
    parse: Callable[[str], Any]
    default: Any
    help: str

    @property
    def dest(self) -> str:
        """The attribute of the parsed namespace: --min-replicas -> min_replicas."""
        return self.flag.removeprefix("--").replace("-", "_")


def text(value: str) -> str:
    """A string setting, taken as given."""
    return value


def integer(minimum: int) -> Callable[[str], int]:
    """An integer >= ``minimum``; a ValueError says what is wrong with the text."""

    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise ValueError(f"invalid int value: {value!r}") from None
        if number < minimum:
            raise ValueError(f"must be an integer >= {minimum}, got {value!r}")
        return number

    return parse


def number(minimum: float, *, strict: bool) -> Callable[[str], float]:
    """A number >= ``minimum`` (``strict``: >); NaN is refused (it compares false to every bound)."""

    def parse(value: str) -> float:
        try:
            result = float(value)
        except ValueError:
            raise ValueError(f"invalid float value: {value!r}") from None
        if not (result > minimum or (result == minimum and not strict)):
            raise ValueError(f"must be a number {'>' if strict else '>='} {minimum:g}, got {value!r}")
        return result

    return parse


def host_port(value: str) -> str:
    """HOST:PORT to listen on."""
    _, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"must be HOST:PORT (e.g. 0.0.0.0:{contract.LIGHTHOUSE_PORT}), got {value!r}")
    return value


def generations(value: str) -> dict[str, int]:
    """GROUP:GENERATION,... as group id -> generation."""
    return contract.parse_generations(value)


SETTINGS: tuple[Setting, ...] = (
    Setting("--bind", contract.ENV_LIGHTHOUSE_BIND, host_port, f"0.0.0.0:{contract.LIGHTHOUSE_PORT}",
            "HOST:PORT to listen on; port 0 picks a free one"),
    Setting("--min-replicas", contract.ENV_MIN_REPLICAS, integer(1), 1,
            "groups a quorum needs; below it nothing commits"),
    Setting("--replicas", contract.ENV_REPLICAS, integer(1), None,
            "groups that contribute; extra live groups are spares; unset: every up-to-date group"),
    Setting("--groups", contract.ENV_GROUPS, integer(1), None,
            "replica group ids are 0..GROUPS-1 (replicas + spares) and any other is refused with 403; unset: any "
            "decimal id (the operator sets it and updates it on scaling)"),
    Setting("--join-timeout", contract.ENV_JOIN_TIMEOUT_S, number(0, strict=False), 1.0,
            "seconds a quorum waits for live or starting groups that have not asked yet"),
    Setting("--heartbeat-timeout", contract.ENV_HEARTBEAT_TIMEOUT_S, number(0, strict=True), 5.0,
            "seconds without a heartbeat before a group is dropped"),
    Setting("--state-file", contract.ENV_LIGHTHOUSE_STATE_FILE, text, None,
            "keeps the quorum id and committed step across restarts"),
    Setting("--restore-quorum-id", contract.ENV_RESTORE_QUORUM_ID, integer(0), 0,
            "quorum ids go on above this one (the operator sets the last id it saw when it replaces a lost "
            "lighthouse)"),
    Setting("--restore-step", contract.ENV_RESTORE_STEP, integer(0), 0,
            "no quorum starts below this committed step while --restore-window lasts"),
    Setting("--restore-window", contract.ENV_RESTORE_WINDOW_S, number(0, strict=False), 120.0,
            "seconds to wait for a group holding --restore-step before going on from the best one that asks"),
    Setting("--group-generations", contract.ENV_GROUP_GENERATIONS, generations, {},
            "GROUP:GENERATION,...: each group's oldest generation that still runs; a process of an older one is "
            "refused (the operator sets it on a replacement lighthouse and declares it again once the lighthouse "
            "answers)"),
    Setting("--guard-max-offences", contract.ENV_GUARD_MAX_OFFENCES, integer(1), DEFAULT_MAX_OFFENCES,
            "a group's incarnation whose gradient the guard refused in this many steps within --guard-window-s is "
            "evicted"),
    Setting("--guard-window-s", contract.ENV_GUARD_WINDOW_S, number(0, strict=True), float(DEFAULT_WINDOW_S),
            "seconds in which --guard-max-offences offences evict a group"),
    Setting("--stall-factor", contract.ENV_STALL_FACTOR, number(0, strict=False), float(DEFAULT_FACTOR),
            "evict a member whose progress stopped for max(--stall-floor-s, this x the median step) while every "
            "other member waits in the step's collective; 0: off"),
    Setting("--stall-floor-s", contract.ENV_STALL_FLOOR_S, number(0, strict=True), float(DEFAULT_FLOOR_S),
            "the stall rule never fires sooner than this many seconds"),
    Setting("--audit-file", contract.ENV_AUDIT_FILE, text, None,
            "also append the audit trail's JSON lines to this file; they always go to stderr"),
    Setting("--token-file", contract.ENV_TOKEN_FILE, text, None,
            f"file holding the job's bearer token (or the token itself in {contract.ENV_TOKEN})"),
    Setting("--operator-token-file", contract.ENV_OPERATOR_TOKEN_FILE, text, None,
            "file holding the operator's bearer token, the only one the membership API accepts; it must differ from "
            f"the job's (or the token itself in {contract.ENV_OPERATOR_TOKEN})"),
    Setting("--tls-cert", contract.ENV_TLS_CERT_FILE, text, None,
            "serve HTTPS/WSS only, with this certificate chain (PEM); with --tls-key. Unset: plain HTTP (local "
            "development only)"),
    Setting("--tls-key", contract.ENV_TLS_KEY_FILE, text, None, "the certificate's private key (PEM)"),
)  # fmt: skip


def _shown(default: Any) -> str:
    if default is None or default == {}:
        return "unset"
    return f"{default:g}" if isinstance(default, float) else str(default)


def build_parser() -> argparse.ArgumentParser:
    """The lighthouse's flags, one per SETTINGS row; each help names its env variable and default. Parsing with it
    alone leaves an absent flag None: parse_args falls back to the environment, then the default."""
    p = argparse.ArgumentParser(
        prog="ftjob-trainer lighthouse",
        description="The per-step quorum service of one job. Every flag falls back to the environment variable named "
        "in its help (the operator sets them), then to the default shown.",
    )
    for s in SETTINGS:
        p.add_argument(s.flag, default=None, help=f"{s.help} (env {s.env}; default: {_shown(s.default)})")
    return p


def parse_args(argv: list[str], environ: Mapping[str, str] | None = None) -> argparse.Namespace:
    """The settings: each flag, else its env variable (an empty one is unset), else its default; a bad value of
    either exits 2 naming the flag and the variable."""
    env = os.environ if environ is None else environ
    p = build_parser()
    args = p.parse_args(argv)
    for s in SETTINGS:
        given = getattr(args, s.dest)
        raw = given if given is not None else env.get(s.env) or None
        try:
            setattr(args, s.dest, copy.copy(s.default) if raw is None else s.parse(raw))  # no shared {}
        except ValueError as e:
            p.error(f"{s.flag} (env {s.env}): {e}")
    if bool(args.tls_cert) != bool(args.tls_key):
        p.error("--tls-cert and --tls-key go together: give both (TLS) or neither (plain HTTP)")
    host, _, port = args.bind.rpartition(":")
    args.host, args.port = host or "0.0.0.0", int(port)
    if args.groups is not None and args.groups < (args.replicas or 1):
        p.error(f"--groups must be >= --replicas, got {args.groups} < {args.replicas}")
    outside = [g for g in args.group_generations if args.groups is not None and int(g) >= args.groups]
    if outside:
        p.error(f"--group-generations names group(s) {outside} outside 0..{args.groups - 1} (--groups)")
    if args.audit_file:
        try:
            open(args.audit_file, "a", encoding="utf-8").close()
        except OSError as e:
            p.error(f"--audit-file (env {contract.ENV_AUDIT_FILE}): cannot append to {args.audit_file!r}: {e}")
    return args


def read_token(token_file: str | None) -> str:
    if token_file:
        with open(token_file, encoding="utf-8") as f:
            return f.read().strip()
    return contract.read_token()


def read_operator_token(token_file: str | None) -> str:
    if token_file:
        with open(token_file, encoding="utf-8") as f:
            return f.read().strip()
    return contract.read_operator_token()


def build_server(args: argparse.Namespace, token: str, operator_token: str) -> LighthouseServer:
    saved = load_state(args.state_file)
    restored_floor = args.restore_step > saved.committed_step  # the operator's record, not this lighthouse's own
    core = QuorumCore(
        min_replicas=args.min_replicas,
        join_timeout_s=args.join_timeout,
        heartbeat_timeout_s=args.heartbeat_timeout,
        quorum_id=max(saved.quorum_id, args.restore_quorum_id),
        committed_step=max(saved.committed_step, args.restore_step),
        step_floor_until=time.monotonic() + args.restore_window if restored_floor else None,
        stall=StallRule(args.stall_factor, args.stall_floor_s),
    )
    if args.replicas is not None:
        core.set_desired(args.replicas, args.groups)
    elif args.groups is not None:
        core.group_limit = args.groups
    if args.group_generations:
        core.declare_generations(args.group_generations, time.monotonic())  # no member yet: nothing to evict
    if (args.restore_quorum_id or args.restore_step or saved.quorum_id) and core.group_limit:
        core.expect_back(str(g) for g in range(core.group_limit))  # a replacement: the groups are coming back
    integrity = IntegrityChecks(max_offences=args.guard_max_offences, window_s=args.guard_window_s)
    return LighthouseServer(core, token, operator_token, state_file=args.state_file, integrity=integrity,
                            audit_file=args.audit_file)  # fmt: skip


async def serve(args: argparse.Namespace, token: str, operator_token: str) -> None:
    server = build_server(args, token, operator_token)
    # Shutdown must be quick: a lighthouse that is being replaced holds every group's next step.
    runner = JsonErrorRunner(server.make_app(), access_log=None, shutdown_timeout=SHUTDOWN_GRACE_S)
    await runner.setup()
    tls = server_context(args.tls_cert, args.tls_key) if args.tls_cert else None  # then TLS only: plain HTTP fails
    site = web.TCPSite(runner, args.host, args.port, reuse_address=True, ssl_context=tls,
                       backlog=LISTEN_BACKLOG)  # fmt: skip
    await site.start()
    port = site.port  # once started, the port bound (the kernel's pick for a --bind with port 0)
    print(
        f"lighthouse listening on {args.host}:{port} over {'TLS' if tls else 'plain HTTP'} "
        f"(min_replicas={args.min_replicas}, "
        f"quorum_id={server.core.quorum_id}, committed_step={server.core.committed_step})",
        flush=True,
    )
    # this process's garbage collector, paced for a heap of many long-lived connections (ftjob.lighthouse.gc_pacing)
    metrics = server.metrics
    pacer = GcPacer(connections=lambda: server.open_sockets, on_full=metrics.gc_full_seconds.observe,
                    on_tick=metrics.gc_ticks.inc)  # fmt: skip
    pacing = asyncio.create_task(pacer.run())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    pacing.cancel()
    log.info("stopping: telling every waiting group to retry elsewhere")
    await server.shutdown()
    await runner.cleanup()


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    configure_audit_logging()  # the audit trail: bare JSON lines on stderr, whatever the format above
    args = parse_args(argv)
    try:
        token = read_token(args.token_file)
        operator_token = read_operator_token(args.operator_token_file)
    except OSError as e:
        print(f"error: cannot read the token file: {e}", file=sys.stderr)
        return 2
    if not token:
        print(
            f"error: no bearer token: set {contract.ENV_TOKEN}, {contract.ENV_TOKEN_FILE} or --token-file",
            file=sys.stderr,
        )
        return 2
    try:
        Credentials(token, operator_token)  # both, and not the same: checked before anything starts
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(args, token, operator_token))
    except (ValueError, OSError) as e:  # unreadable state file or TLS files (ssl.SSLError is an OSError), port taken
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
