"""``ftjob-trainer lighthouse``: the per-job quorum service (see quorum for the rule, server for
the API). Flags override the FTJOB_* environment variables the operator sets."""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Callable

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


def _bounded(convert: Callable[[str], float], minimum: float, strict: bool, env_name: str) -> Callable[[str], float]:
    """An argparse type: a number >= (``strict``: >) ``minimum``; the error names the flag's env variable too."""

    def parse(text: str) -> float:
        try:
            value = convert(text)
        except ValueError:
            value = math.nan
        if not (value > minimum or (value == minimum and not strict)):
            bound = f"{'>' if strict else '>='} {minimum:g}"
            kind = "an integer" if convert is int else "a number"
            raise argparse.ArgumentTypeError(f"must be {kind} {bound} (flag or env {env_name}), got {text!r}")
        return value

    return parse


def parse_args(argv: list[str]) -> argparse.Namespace:
    env = os.environ
    p = argparse.ArgumentParser(
        prog="ftjob-trainer lighthouse",
        description="The per-step quorum service of one job. Every flag falls back to the environment variable named "
        "in its help (the operator sets them), then to the default shown.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    a = p.add_argument
    a(
        "--bind",
        default=env.get(contract.ENV_LIGHTHOUSE_BIND, f"0.0.0.0:{contract.LIGHTHOUSE_PORT}"),
        help=f"HOST:PORT to listen on (env {contract.ENV_LIGHTHOUSE_BIND}; port 0 picks a free one)",
    )
    a(
        "--min-replicas",
        type=int,
        default=int(env.get(contract.ENV_MIN_REPLICAS, "1")),
        help=f"groups a quorum needs; below it nothing commits (env {contract.ENV_MIN_REPLICAS})",
    )
    a(
        "--replicas",
        type=int,
        default=int(env[contract.ENV_REPLICAS]) if env.get(contract.ENV_REPLICAS) else None,
        help=f"groups that contribute; extra live groups are spares; None: every up-to-date group "
        f"(env {contract.ENV_REPLICAS})",
    )
    a(
        "--groups",
        type=int,
        default=int(env[contract.ENV_GROUPS]) if env.get(contract.ENV_GROUPS) else None,
        help=f"replica group ids are 0..GROUPS-1 (replicas + spares) and any other is refused with 403; None: any "
        f"decimal id (env {contract.ENV_GROUPS}; the operator sets it and updates it on scaling)",
    )
    a(
        "--join-timeout",
        type=float,
        default=float(env.get(contract.ENV_JOIN_TIMEOUT_S, "1.0")),
        help=f"seconds a quorum waits for live or starting groups that have not asked yet "
        f"(env {contract.ENV_JOIN_TIMEOUT_S})",
    )
    a(
        "--heartbeat-timeout",
        type=float,
        default=float(env.get(contract.ENV_HEARTBEAT_TIMEOUT_S, "5.0")),
        help=f"seconds without a heartbeat before a group is dropped (env {contract.ENV_HEARTBEAT_TIMEOUT_S})",
    )
    a(
        "--state-file",
        default=env.get(contract.ENV_LIGHTHOUSE_STATE_FILE),
        help=f"keeps the quorum id and committed step across restarts (env {contract.ENV_LIGHTHOUSE_STATE_FILE})",
    )
    a(
        "--restore-quorum-id",
        type=int,
        default=int(env.get(contract.ENV_RESTORE_QUORUM_ID, "0")),
        help=f"quorum ids go on above this one (env {contract.ENV_RESTORE_QUORUM_ID}; the operator sets the last id "
        "it saw when it replaces a lost lighthouse)",
    )
    a(
        "--restore-step",
        type=int,
        default=int(env.get(contract.ENV_RESTORE_STEP, "0")),
        help=f"no quorum starts below this committed step while --restore-window lasts "
        f"(env {contract.ENV_RESTORE_STEP})",
    )
    a(
        "--restore-window",
        type=float,
        default=float(env.get(contract.ENV_RESTORE_WINDOW_S, "120")),
        help=f"seconds to wait for a group holding --restore-step before going on from the best one that asks "
        f"(env {contract.ENV_RESTORE_WINDOW_S})",
    )
    a(
        "--group-generations",
        default=env.get(contract.ENV_GROUP_GENERATIONS, ""),
        help=f"GROUP:GENERATION,...: each group's oldest generation that still runs; a process of an older one is "
        f"refused (env {contract.ENV_GROUP_GENERATIONS}; the operator sets it on a replacement lighthouse and "
        "declares it again once the lighthouse answers)",
    )
    a(
        "--guard-max-offences",
        type=_bounded(int, 1, False, contract.ENV_GUARD_MAX_OFFENCES),
        default=env.get(contract.ENV_GUARD_MAX_OFFENCES) or str(DEFAULT_MAX_OFFENCES),
        help=f"a group's incarnation whose gradient the guard refused in this many steps within --guard-window-s is "
        f"evicted (env {contract.ENV_GUARD_MAX_OFFENCES})",
    )
    a(
        "--guard-window-s",
        type=_bounded(float, 0, True, contract.ENV_GUARD_WINDOW_S),
        default=env.get(contract.ENV_GUARD_WINDOW_S) or f"{DEFAULT_WINDOW_S:g}",
        help=f"seconds in which --guard-max-offences offences evict a group (env {contract.ENV_GUARD_WINDOW_S})",
    )
    a(
        "--stall-factor",
        type=_bounded(float, 0, False, contract.ENV_STALL_FACTOR),
        default=env.get(contract.ENV_STALL_FACTOR) or f"{DEFAULT_FACTOR:g}",
        help=f"evict a member whose progress stopped for max(--stall-floor-s, this x the median step) while every "
        f"other member waits in the step's collective; 0: off (env {contract.ENV_STALL_FACTOR})",
    )
    a(
        "--stall-floor-s",
        type=_bounded(float, 0, True, contract.ENV_STALL_FLOOR_S),
        default=env.get(contract.ENV_STALL_FLOOR_S) or f"{DEFAULT_FLOOR_S:g}",
        help=f"the stall rule never fires sooner than this many seconds (env {contract.ENV_STALL_FLOOR_S})",
    )
    a(
        "--audit-file",
        default=env.get(contract.ENV_AUDIT_FILE) or None,
        help=f"also append the audit trail's JSON lines to this file; they always go to stderr "
        f"(env {contract.ENV_AUDIT_FILE})",
    )
    a(
        "--token-file",
        default=env.get(contract.ENV_TOKEN_FILE),
        help=f"file holding the job's bearer token (env {contract.ENV_TOKEN_FILE}, or the token itself in "
        f"{contract.ENV_TOKEN})",
    )
    a(
        "--operator-token-file",
        default=env.get(contract.ENV_OPERATOR_TOKEN_FILE),
        help=f"file holding the operator's bearer token, the only one the membership API accepts; it must differ from "
        f"the job's (env {contract.ENV_OPERATOR_TOKEN_FILE}, or the token itself in {contract.ENV_OPERATOR_TOKEN})",
    )
    a(
        "--tls-cert",
        default=env.get(contract.ENV_TLS_CERT_FILE) or None,
        help=f"serve HTTPS/WSS only, with this certificate chain (PEM; env {contract.ENV_TLS_CERT_FILE}); with "
        "--tls-key. Unset: plain HTTP (local development only)",
    )
    a(
        "--tls-key",
        default=env.get(contract.ENV_TLS_KEY_FILE) or None,
        help=f"the certificate's private key (PEM; env {contract.ENV_TLS_KEY_FILE})",
    )
    args = p.parse_args(argv)
    if bool(args.tls_cert) != bool(args.tls_key):
        p.error("--tls-cert and --tls-key go together: give both (TLS) or neither (plain HTTP)")
    host, sep, port = args.bind.rpartition(":")
    if not sep or not port.isdigit():
        p.error(f"--bind must be HOST:PORT (e.g. 0.0.0.0:{contract.LIGHTHOUSE_PORT}), got {args.bind!r}")
    args.host, args.port = host or "0.0.0.0", int(port)
    if args.min_replicas < 1:
        p.error(f"--min-replicas must be >= 1, got {args.min_replicas}")
    if args.join_timeout < 0 or args.heartbeat_timeout <= 0:
        p.error("--join-timeout must be >= 0 and --heartbeat-timeout > 0")
    if args.restore_quorum_id < 0 or args.restore_step < 0 or args.restore_window < 0:
        p.error("--restore-quorum-id, --restore-step and --restore-window must be >= 0")
    if args.replicas is not None and args.replicas < 1:
        p.error(f"--replicas must be >= 1, got {args.replicas}")
    if args.groups is not None and args.groups < max(1, args.replicas or 1):
        p.error(f"--groups must be >= 1 and >= --replicas, got {args.groups}")
    try:
        args.group_generations = contract.parse_generations(args.group_generations)
    except ValueError as e:
        p.error(f"--group-generations (env {contract.ENV_GROUP_GENERATIONS}): {e}")
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
    port = site._server.sockets[0].getsockname()[1] if args.port == 0 and site._server else args.port
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
