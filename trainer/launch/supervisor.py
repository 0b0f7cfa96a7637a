"""``ftjob-trainer supervise``: the in-pod supervisor that runs one rank process per GPU of a pod.

    ftjob-trainer supervise [--ranks N] [--grace-seconds S] -- COMMAND [ARGS...]

A job with ``spec.ranksPerPod`` N > 1 runs one pod per node and N ranks in it (torchrun's ``--nproc-per-node``): the
operator starts the pod's training container as ``ftjob-trainer supervise -- <its command>``, and this starts N
processes of that command, each with the env of one rank of the replica group:

  LOCAL_RANK          k, for k in 0..N-1
  RANK                FTJOB_POD_RANK * N + k (FTJOB_POD_RANK: this pod's index in its group, default 0)
  LOCAL_WORLD_SIZE    N
  WORLD_SIZE          as the pod has it (podsPerReplica * N; default N); it must be a multiple of N that holds this
                      pod's ranks
  FTJOB_RECOVERY_PORT, FTJOB_STORE_PORT, FTJOB_METRICS_PORT
                      the pod's port + 100 * k (ftjob.contract.rank_port) when the pod's is set and not 0, so the
                      ranks' per-rank servers never collide; unset or 0 (an ephemeral port, or no server) stays so
  OMP_NUM_THREADS     the pod's value divided among its N ranks (at least 1), or 1 when the pod sets none and N > 1
                      (torchrun's default): the operator sizes it for the pod's CPUs, and N ranks each starting that
                      many threads would oversubscribe them N times
and everything else of the pod's env unchanged; N defaults to FTJOB_RANKS_PER_POD (default 1, so a command can run
under the supervisor everywhere).

Devices: every GPU of the pod stays visible to every rank, and a rank binds the GPU of its LOCAL_RANK
(``torch.cuda.set_device(LOCAL_RANK)``, as ``ftjob.ft.init()`` and the reference trainer do; torchrun's convention).
NCCL then sees every peer GPU of the node and can use NVLink between them; hiding all but one GPU per process can cost
NCCL its direct paths, and would leave LOCAL_RANK naming a device the rank cannot see. A script that always uses
``cuda:0`` should call ``torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))`` first (or ``ftjob.ft.init()``, which
does), and then use ``"cuda"`` or ``torch.cuda.current_device()``.

Output: each rank's stdout and stderr (merged) come out on the supervisor's stdout, each line prefixed
``[rank R] `` with the rank's global RANK. Lines are written whole (one rank's line never interleaves with
another's); a line longer than 1 MiB is cut into 1 MiB lines. The supervisor's own lines start ``[supervise] ``.
The ranks' stdin is /dev/null: N processes cannot share one input.

Failures and exit code (a group restarts as one unit, so the pod must not outlive one of its ranks):
  * every rank exits 0: the supervisor exits 0;
  * a rank exits non-zero or is killed by a signal: the supervisor SIGKILLs every other rank at once (survivors
    would hang in their collectives), prints ``[supervise] rank R exited with code C; stopping the other ranks``
    (``... (signal NAME)`` for a signal death) and exits with C, where a death by signal S counts as 128 + S, as in a
    shell (SIGKILL: 137). The first failure wins;
  * SIGTERM or SIGINT to the supervisor (the kubelet stopping the pod, Ctrl-C): it is forwarded to every rank, which
    may shut down cleanly; ranks still running ``--grace-seconds`` later are SIGKILLed, and the supervisor exits
    128 + that signal. When every rank exits by itself within the grace, the supervisor exits with their codes: 0 if
    all exited 0, else the first non-zero code;
  * COMMAND cannot be started: 127 (not found) or 126 (not executable), as a shell, after killing any rank started;
  * bad arguments or env: one line on stderr and exit 2, before any rank starts.
The grace defaults to FTJOB_SUPERVISE_GRACE_S, else 25 s: a little below Kubernetes' default
terminationGracePeriodSeconds (30 s), so the supervisor's SIGKILL and its last line come before the kubelet's.
Set it a little below the pod's terminationGracePeriodSeconds when that is longer.

Processes: each rank leads its own process group (its own session), and every signal the supervisor sends goes to
the whole group, so it also reaches what the rank started (data-loader workers, a shell's children). Each rank also
gets SIGKILL when the supervisor dies (PR_SET_PDEATHSIG, Linux): a supervisor SIGKILLed from outside (the local
launcher killing a group, the OOM killer) leaves no rank running. As PID 1 of a container it reaps every child,
orphans re-parented to it included, so nothing stays a zombie: it waits with ``os.waitpid(-1)`` on every SIGCHLD.
That also means it must be the only code in its process that starts children: run it as its own command.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import IO

from ftjob import contract

PROG = "ftjob-trainer supervise"
# Seconds between forwarding SIGTERM/SIGINT and SIGKILLing the ranks still running. An operator that sets it puts it
# a little below the pod's terminationGracePeriodSeconds, so the supervisor acts and reports before the kubelet.
ENV_SUPERVISE_GRACE_S = "FTJOB_SUPERVISE_GRACE_S"
DEFAULT_GRACE_S = 25.0
LINE_LIMIT = 1 << 20  # a rank's line longer than this is cut: a reader never holds more than this much of a line
READER_JOIN_S = 2.0  # bound on waiting for a rank's last output: an orphan of the rank may keep its pipe open
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
PER_RANK_PORTS = (contract.ENV_RECOVERY_PORT, contract.ENV_CROSS_GROUP_STORE_PORT, contract.ENV_METRICS_PORT)


class UsageError(ValueError):
    """A bad flag or env value: reported in one line, exit 2."""


@dataclass(frozen=True)
class SuperviseConfig:
    ranks: int  # N: rank processes in this pod
    pod_rank: int  # this pod's index in its group
    world_size: int  # ranks in the whole group
    grace_s: float  # after a forwarded SIGTERM/SIGINT, SIGKILL what still runs this much later
    command: list[str]

    def global_rank(self, local_rank: int) -> int:
        return self.pod_rank * self.ranks + local_rank


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog=PROG,
        usage=f"{PROG} [--ranks N] [--grace-seconds S] -- COMMAND [ARGS...]",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--ranks",
        metavar="N",
        help=f"rank processes to start (env {contract.ENV_RANKS_PER_POD}, default 1; 1..{contract.MAX_RANKS_PER_POD})",
    )
    p.add_argument(
        "--grace-seconds",
        metavar="S",
        help=f"after forwarding SIGTERM/SIGINT, SIGKILL the ranks still running this much later "
        f"(env {ENV_SUPERVISE_GRACE_S}, default {DEFAULT_GRACE_S:g})",
    )
    return p


def _integer(raw: str, what: str, source: str) -> int:
    try:
        return int(raw.strip())
    except ValueError:
        raise UsageError(f"{what} must be an integer; got {source}") from None


def parse(argv: list[str], environ: Mapping[str, str] | None = None) -> SuperviseConfig:
    """The supervisor's settings from its arguments and the pod's env; UsageError says what is wrong."""
    env = os.environ if environ is None else environ
    if "--" in argv:
        i = argv.index("--")
        own, command = argv[:i], argv[i + 1 :]
    else:
        own, command = argv, []
    args = build_parser().parse_args(own)
    if not command:
        raise UsageError("the command to run goes after --, e.g. `ftjob-trainer supervise -- python train.py`")

    ranks_what = f"--ranks (default: env {contract.ENV_RANKS_PER_POD}, else 1)"
    if args.ranks is not None:
        ranks_raw, ranks_source = args.ranks, f"--ranks {args.ranks!r}"
    else:
        ranks_raw = env.get(contract.ENV_RANKS_PER_POD, "").strip() or "1"
        ranks_source = f"env {contract.ENV_RANKS_PER_POD}={env.get(contract.ENV_RANKS_PER_POD)!r}"
    ranks = _integer(ranks_raw, ranks_what, ranks_source)
    if not 1 <= ranks <= contract.MAX_RANKS_PER_POD:
        raise UsageError(f"{ranks_what} must be between 1 and {contract.MAX_RANKS_PER_POD}; got {ranks_source}")

    def env_int(name: str, default: int) -> int:
        raw = env.get(name, "").strip()
        return _integer(raw, f"env {name}", repr(raw)) if raw else default

    pod_rank = env_int(contract.ENV_POD_RANK, 0)
    if pod_rank < 0:
        raise UsageError(f"env {contract.ENV_POD_RANK} must be >= 0; got {pod_rank}")
    world_size = env_int(contract.ENV_WORLD_SIZE, ranks)
    if world_size % ranks or world_size < (pod_rank + 1) * ranks:
        raise UsageError(
            f"env {contract.ENV_WORLD_SIZE}={world_size} must be a multiple of the pod's {ranks} ranks (--ranks or "
            f"env {contract.ENV_RANKS_PER_POD}) and at least ({contract.ENV_POD_RANK} {pod_rank} + 1) x {ranks} = "
            f"{(pod_rank + 1) * ranks}: the group's ranks up to this pod's"
        )
    for name in PER_RANK_PORTS:
        base = env_int(name, 0)
        if base < 0 or contract.rank_port(base, ranks - 1) > 65535:
            raise UsageError(
                f"env {name}={base} leaves no valid port for each of {ranks} ranks (local rank k gets "
                f"{name} + {contract.RANK_PORT_STRIDE} x k, at most 65535)"
            )

    grace_what = f"--grace-seconds (default: env {ENV_SUPERVISE_GRACE_S}, else {DEFAULT_GRACE_S:g})"
    if args.grace_seconds is not None:
        grace_raw, grace_source = args.grace_seconds, f"--grace-seconds {args.grace_seconds!r}"
    else:
        grace_raw = env.get(ENV_SUPERVISE_GRACE_S, "").strip() or str(DEFAULT_GRACE_S)
        grace_source = f"env {ENV_SUPERVISE_GRACE_S}={env.get(ENV_SUPERVISE_GRACE_S)!r}"
    try:
        grace_s = float(grace_raw)
    except ValueError:
        grace_s = math.nan
    if not (math.isfinite(grace_s) and grace_s >= 0):
        raise UsageError(f"{grace_what} must be a number of seconds >= 0; got {grace_source}")
    return SuperviseConfig(ranks=ranks, pod_rank=pod_rank, world_size=world_size, grace_s=grace_s, command=command)


def rank_env(cfg: SuperviseConfig, local_rank: int, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The env of local rank ``local_rank``: the pod's, with torch's per-rank names and the per-rank ports."""
    env = dict(os.environ if environ is None else environ)
    env.update(
        {
            contract.ENV_RANK: str(cfg.global_rank(local_rank)),
            contract.ENV_LOCAL_RANK: str(local_rank),
            contract.ENV_LOCAL_WORLD_SIZE: str(cfg.ranks),
            contract.ENV_WORLD_SIZE: str(cfg.world_size),
            contract.ENV_RANKS_PER_POD: str(cfg.ranks),
            contract.ENV_POD_RANK: str(cfg.pod_rank),
        }
    )
    for name in PER_RANK_PORTS:
        base = int(env.get(name, "").strip() or 0)
        if base:
            env[name] = str(contract.rank_port(base, local_rank))
    if cfg.ranks > 1:
        threads = env.get("OMP_NUM_THREADS", "").strip()
        env["OMP_NUM_THREADS"] = str(max(1, int(threads) // cfg.ranks)) if threads.isdigit() else "1"
    return env


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _shell_code(returncode: int) -> int:
    """Popen's code (a death by signal S reads -S) as a shell reports it: 128 + S."""
    return 128 - returncode if returncode < 0 else returncode


def _die_with_parent_hook() -> Callable[[], None] | None:
    """A preexec_fn that makes the child get SIGKILL when the supervisor dies (Linux), or None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)  # loaded here: the child must not load libraries between fork and exec
        prctl = libc.prctl
        prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the supervisor died before the hook ran: the signal will never come
            os._exit(137)

    return hook


class Supervisor:
    """Runs the ranks of one pod to the end; ``run()`` returns the supervisor's exit code."""

    def __init__(self, cfg: SuperviseConfig, out: IO[bytes] | None = None) -> None:
        self.cfg = cfg
        self.out = out if out is not None else sys.stdout.buffer
        self._out_lock = threading.Lock()
        self._out_broken = False
        self.procs: list[subprocess.Popen[bytes]] = []
        self.codes: dict[int, int] = {}  # local rank -> shell-style exit code, once reaped
        self._order: list[int] = []  # local ranks in the order they exited
        self._by_pid: dict[int, int] = {}
        self._readers: list[threading.Thread] = []
        self._failure: tuple[int, int, int] | None = None  # (local rank, shell code, signal or 0)
        self._stop_signal: int | None = None
        self._deadline: float | None = None
        self._grace_expired = False
        self._wake_r = self._wake_w = -1

    # --- output --------------------------------------------------------------------------------------------------
    def _write(self, line: bytes) -> None:
        """One whole line to the supervisor's stdout; a closed stdout is ignored so the ranks' pipes keep draining
        (a rank blocked on a full pipe would hang)."""
        with self._out_lock:
            if self._out_broken:
                return
            try:
                self.out.write(line)
                self.out.flush()
            except (OSError, ValueError):
                self._out_broken = True

    def say(self, msg: str) -> None:
        self._write(f"[supervise] {msg}\n".encode())

    def _pump(self, local_rank: int, stream: IO[bytes]) -> None:
        prefix = f"[rank {self.cfg.global_rank(local_rank)}] ".encode()
        with stream:
            while line := stream.readline(LINE_LIMIT):
                self._write(prefix + (line if line.endswith(b"\n") else line + b"\n"))

    # --- signals -------------------------------------------------------------------------------------------------
    def _install_signals(self) -> dict[int, object]:
        """The wake-up pipe gets one byte per signal (its number): the loop reads what happened from it, so a signal
        arriving at any moment, in any thread, wakes the loop at once and is never lost."""
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        previous = {s: signal.getsignal(s) for s in (*STOP_SIGNALS, signal.SIGCHLD)}
        for s in previous:
            signal.signal(s, lambda *_: None)  # a Python handler makes CPython write the wake-up byte
        signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        return previous

    def _restore_signals(self, previous: dict[int, object]) -> None:
        signal.set_wakeup_fd(-1)
        for s, handler in previous.items():
            signal.signal(s, handler)  # type: ignore[arg-type]
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)

    def _wait_for_wakeup(self, timeout: float) -> list[int]:
        """The signals received since the last call, waiting up to ``timeout`` seconds for one."""
        select.select([self._wake_r], [], [], max(0.0, timeout))
        got = b""
        while True:
            try:
                chunk = os.read(self._wake_r, 4096)
            except BlockingIOError:
                break
            if not chunk:
                break
            got += chunk
        return list(got)

    # --- processes -----------------------------------------------------------------------------------------------
    def _start(self) -> None:
        hook = _die_with_parent_hook()
        for k in range(self.cfg.ranks):
            proc = subprocess.Popen(
                self.cfg.command,
                env=rank_env(self.cfg, k),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=hook,  # safe here: no other thread runs yet, the readers start after the last rank
            )
            self.procs.append(proc)
            self._by_pid[proc.pid] = k
        first = self.cfg.global_rank(0)
        self.say(
            f"started {self.cfg.ranks} rank(s): RANK {first}..{first + self.cfg.ranks - 1} of WORLD_SIZE "
            f"{self.cfg.world_size}, pids {' '.join(str(p.pid) for p in self.procs)}"
        )
        for k, proc in enumerate(self.procs):  # only now: preexec_fn must not run while other threads exist
            assert proc.stdout is not None
            t = threading.Thread(target=self._pump, args=(k, proc.stdout), name=f"rank-{k}-output", daemon=True)
            t.start()
            self._readers.append(t)

    def _live(self) -> list[int]:
        return [k for k in range(len(self.procs)) if k not in self.codes]

    def _signal_groups(self, signum: int, ranks: list[int]) -> None:
        """``signum`` to the process group of each of ``ranks``: the rank and whatever it started."""
        for k in ranks:
            try:
                os.killpg(self.procs[k].pid, signum)
            except (ProcessLookupError, PermissionError):
                pass  # the group is gone already

    def _reap(self) -> list[int]:
        """Reaps every exited child (orphans re-parented to a PID-1 supervisor too); the ranks that exited."""
        exited = []
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            k = self._by_pid.get(pid)
            if k is None:
                continue  # an orphan: reaping it is all a PID 1 owes it
            returncode = os.waitstatus_to_exitcode(status)
            self.procs[k].returncode = returncode  # Popen must not wait for a pid that is gone (and may be reused)
            self.codes[k] = _shell_code(returncode)
            self._order.append(k)
            exited.append(k)
        return exited

    def _fail(self, k: int) -> None:
        """Rank ``k`` failed: every other rank goes at once, then one line says why."""
        returncode = self.procs[k].returncode or 0
        self._failure = (k, self.codes[k], -returncode if returncode < 0 else 0)
        self._signal_groups(signal.SIGKILL, list(range(len(self.procs))))  # the failed rank's children too
        # The failed rank's last output (a traceback) first, then the verdict; bounded: an orphan may hold the pipe.
        self._readers[k].join(READER_JOIN_S)
        how = f" (signal {_signal_name(self._failure[2])})" if self._failure[2] else ""
        self.say(f"rank {self.cfg.global_rank(k)} exited with code {self._failure[1]}{how}; stopping the other ranks")

    def _stop(self, signum: int) -> None:
        if self._stop_signal is None:
            self._stop_signal = signum
            self._deadline = time.monotonic() + self.cfg.grace_s
            self.say(
                f"{_signal_name(signum)}: forwarded to every rank; SIGKILL for those still running in "
                f"{self.cfg.grace_s:g}s"
            )
        self._signal_groups(signum, self._live())  # a repeated signal is forwarded again

    def _kill_and_wait(self) -> None:
        """SIGKILL every rank started and reap it (the ranks' output no longer matters here)."""
        self._signal_groups(signal.SIGKILL, list(range(len(self.procs))))
        for p in self.procs:
            if p.returncode is None:
                p.wait()
            if p.stdout is not None and not self._readers:
                p.stdout.close()

    def _supervise(self) -> int:
        while True:
            for k in self._reap():
                if self._failure is None and self._stop_signal is None and self.codes[k] != 0:
                    self._fail(k)
            if not self._live():
                break
            now = time.monotonic()
            if self._deadline is not None and now >= self._deadline and not self._grace_expired:
                self._grace_expired = True
                still = ", ".join(str(self.cfg.global_rank(k)) for k in self._live())
                self.say(f"grace of {self.cfg.grace_s:g}s over: SIGKILL rank(s) {still}")
                self._signal_groups(signal.SIGKILL, list(range(len(self.procs))))
            # The timeout only bounds a wait for the grace deadline; every exit and signal wakes the wait itself.
            timeout = 1.0 if self._deadline is None or self._grace_expired else min(1.0, self._deadline - now)
            for signum in self._wait_for_wakeup(timeout):
                if signum in STOP_SIGNALS and self._failure is None:
                    self._stop(signum)
        # The pod ends with its ranks: what they left running (a daemon child) goes too, here as it would with the
        # container, so it cannot outlive the supervisor when no PID namespace ends with it (the local launcher).
        self._signal_groups(signal.SIGKILL, list(range(len(self.procs))))
        for t in self._readers:
            t.join(READER_JOIN_S)
        if self._failure is not None:
            return self._failure[1]
        if self._stop_signal is not None and self._grace_expired:
            return 128 + self._stop_signal
        return next((self.codes[k] for k in self._order if self.codes[k] != 0), 0)

    def run(self) -> int:
        previous = self._install_signals()  # first: a SIGTERM during the start must not kill the supervisor alone
        try:
            try:
                self._start()
            except OSError as e:
                self._kill_and_wait()
                print(f"{PROG}: cannot start {self.cfg.command[0]!r}: {e.strerror or e}", file=sys.stderr)
                return 127 if isinstance(e, FileNotFoundError) else 126
            return self._supervise()
        except BaseException:
            self._kill_and_wait()  # a fault in the supervisor itself must not leave ranks running without it
            raise
        finally:
            self._restore_signals(previous)


def main(argv: list[str] | None = None) -> int:
    """``ftjob-trainer supervise ...``: the exit code as the module docstring describes."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg = parse(argv)
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    return Supervisor(cfg).run()


if __name__ == "__main__":
    sys.exit(main())
