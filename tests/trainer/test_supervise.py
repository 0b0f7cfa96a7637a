"""`ftjob-trainer supervise`: the in-pod supervisor of a pod's rank processes (ftjob.launch.supervisor).

Every test runs the real command as its own process (it installs signal handlers and reaps every child, so never
inside pytest) over small `python -c` ranks, and synchronises on what the ranks print or write, never on sleeps.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ftjob import contract
from ftjob.launch import supervisor

from tests.support.polling import wait_for

SUPERVISE = [sys.executable, "-m", "ftjob.cli", "supervise"]
HANG_GUARD_S = 120  # bounds a broken supervisor's hang; never a timing assertion
# What a pod's env may carry that would change how the supervisor numbers and configures its ranks.
POD_NAMES = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "OMP_NUM_THREADS"}


def pod_env(**values: str) -> dict[str, str]:
    """This test process's env without any pod or rank settings, plus ``values``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FTJOB_") and k not in POD_NAMES}
    return {**env, **values}


def rank(code: str) -> list[str]:
    """A rank's command: Python running ``code`` (unbuffered, so a test sees each line as it is printed)."""
    return [sys.executable, "-u", "-c", code]


class Supervised:
    """A running supervisor; its stdout (stderr merged) is collected line by line as it comes."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [*SUPERVISE, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait(self) -> int:
        """The supervisor's exit code, once all of its output was read."""
        try:
            rc = self.proc.wait(HANG_GUARD_S)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the supervisor did not exit; its output:\n{self.output()}") from None
        self._reader.join(HANG_GUARD_S)
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # its ranks die with it (PR_SET_PDEATHSIG)
            self.proc.wait()

    def output(self) -> str:
        return "\n".join(self.lines)

    def rank_lines(self, global_rank: int) -> list[str]:
        prefix = f"[rank {global_rank}] "
        return [line.removeprefix(prefix) for line in self.lines if line.startswith(prefix)]


def start(procs: list[Any], args: list[str], env: dict[str, str] | None = None) -> Supervised:
    s = Supervised(args, pod_env() if env is None else env)
    procs.append(s)  # killed at the end if a test fails before it exits
    return s


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its reaper counts as dead: it runs no code)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


@pytest.fixture
def pid_dir(tmp_path: Path) -> Iterator[Path]:
    """Where ranks record their pids and their children's (files pid-*); whatever still runs from them at the end
    (a supervisor that failed to kill it) is SIGKILLed, so a failing test leaves no 10-minute sleeper behind."""
    yield tmp_path
    for f in tmp_path.glob("pid-*"):
        for pid in map(int, f.read_text().split()):
            with contextlib.suppress(OSError):
                if alive(pid) and b"sleep(600)" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(pid, signal.SIGKILL)


def wait_for_files(s: Supervised, paths: list[Path], what: str) -> None:
    wait_for(lambda: all(p.exists() for p in paths) or s.proc.poll() is not None, 60, what)
    assert s.proc.poll() is None, f"the supervisor exited early:\n{s.output()}"


# --- env per rank -----------------------------------------------------------------------------------------------
SHOWN = sorted(POD_NAMES | {"FTJOB_RANKS_PER_POD", "FTJOB_POD_RANK", "SOME_POD_SETTING", *supervisor.PER_RANK_PORTS})
PRINT_ENV = f"import json, os; print(json.dumps({{n: os.environ.get(n) for n in {SHOWN!r}}}))"


def envs_by_rank(s: Supervised, ranks: list[int]) -> dict[int, dict[str, str | None]]:
    return {r: json.loads(s.rank_lines(r)[-1]) for r in ranks}


def test_each_rank_gets_its_rank_local_rank_and_ports(procs: list[Any]) -> None:
    env = pod_env(
        FTJOB_RANKS_PER_POD="3",
        FTJOB_POD_RANK="1",
        WORLD_SIZE="9",
        FTJOB_RECOVERY_PORT=str(contract.RECOVERY_PORT),
        FTJOB_STORE_PORT=str(contract.CROSS_GROUP_STORE_PORT),
        FTJOB_METRICS_PORT="0",  # 0: no metrics server, for every rank
        OMP_NUM_THREADS="8",
        SOME_POD_SETTING="kept",
    )
    s = start(procs, ["--", *rank(PRINT_ENV)], env)
    assert s.wait() == 0, s.output()
    envs = envs_by_rank(s, [3, 4, 5])  # pod 1 of a group of 3-rank pods holds ranks 3..5; lines carry the RANK
    for k, (r, e) in enumerate(sorted(envs.items())):
        assert e["RANK"] == str(r) and e["LOCAL_RANK"] == str(k), e
        assert (e["LOCAL_WORLD_SIZE"], e["WORLD_SIZE"], e["FTJOB_RANKS_PER_POD"], e["FTJOB_POD_RANK"]) == (
            "3", "9", "3", "1"
        ), e  # fmt: skip
        assert e["FTJOB_RECOVERY_PORT"] == str(contract.rank_port(contract.RECOVERY_PORT, k)), e
        assert e["FTJOB_STORE_PORT"] == str(contract.rank_port(contract.CROSS_GROUP_STORE_PORT, k)), e
        assert e["FTJOB_METRICS_PORT"] == "0", e
        assert e["OMP_NUM_THREADS"] == "2", e  # the pod's 8 threads shared by its 3 ranks
        assert e["SOME_POD_SETTING"] == "kept", e
    assert len({e["FTJOB_RECOVERY_PORT"] for e in envs.values()}) == 3


def test_one_rank_by_default(procs: list[Any]) -> None:
    s = start(procs, ["--", *rank(PRINT_ENV)], pod_env(FTJOB_RECOVERY_PORT="29520", OMP_NUM_THREADS="4"))
    assert s.wait() == 0, s.output()
    e = envs_by_rank(s, [0])[0]
    assert (e["RANK"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"], e["WORLD_SIZE"]) == ("0", "0", "1", "1"), e
    assert (e["FTJOB_RECOVERY_PORT"], e["OMP_NUM_THREADS"]) == ("29520", "4"), e  # a lone rank keeps the pod's
    assert not [line for line in s.lines if line.startswith("[rank ") and not line.startswith("[rank 0] ")]


# --- a failing rank takes the pod down --------------------------------------------------------------------------
def survivors_code(tmp: Path) -> str:
    """Rank code: every rank but local rank 1 records its pid and a child's, then would run for ten minutes."""
    return f"""
import os, subprocess, sys, time
k = os.environ["LOCAL_RANK"]
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open({str(tmp)!r} + f"/pid-{{k}}.tmp", "w").write(f"{{os.getpid()}} {{child.pid}}")
os.rename({str(tmp)!r} + f"/pid-{{k}}.tmp", {str(tmp)!r} + f"/pid-{{k}}")
time.sleep(600)
"""


def test_a_failing_rank_kills_the_others_and_its_code_is_the_pods(pid_dir: Path, procs: list[Any]) -> None:
    # Local rank 1 exits 3 once ranks 0 and 2 (and a child of each) run; they would otherwise run for 10 minutes.
    code = f"""
import os, sys, time
if os.environ["LOCAL_RANK"] == "1":
    while not all(os.path.exists({str(pid_dir)!r} + f"/pid-{{k}}") for k in (0, 2)):
        time.sleep(0.05)
    print("rank 1 gives up", flush=True)
    sys.exit(3)
exec({survivors_code(pid_dir)!r})
"""
    s = start(procs, ["--ranks=3", "--", *rank(code)], pod_env(FTJOB_POD_RANK="2", WORLD_SIZE="9"))
    assert s.wait() == 3, s.output()
    assert "[supervise] rank 7 exited with code 3; stopping the other ranks" in s.lines, s.output()
    assert s.rank_lines(7) == ["rank 1 gives up"]
    pids = [int(p) for k in (0, 2) for p in (pid_dir / f"pid-{k}").read_text().split()]
    # The ranks were the supervisor's children (reaped before it exited); their children were in their process
    # groups, SIGKILLed with them.
    wait_for(lambda: not any(alive(p) for p in pids), 30, "every other rank and its child to be gone")


def test_a_rank_killed_by_a_signal_makes_the_pod_exit_128_plus_it(pid_dir: Path, procs: list[Any]) -> None:
    code = f"""
import os, signal, time
if os.environ["LOCAL_RANK"] == "1":
    while not os.path.exists({str(pid_dir)!r} + "/pid-0"):
        time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGKILL)
exec({survivors_code(pid_dir)!r})
"""
    s = start(procs, ["--ranks=2", "--", *rank(code)])
    assert s.wait() == 128 + signal.SIGKILL, s.output()
    assert "[supervise] rank 1 exited with code 137 (signal SIGKILL); stopping the other ranks" in s.lines
    pids = [int(p) for p in (pid_dir / "pid-0").read_text().split()]
    wait_for(lambda: not any(alive(p) for p in pids), 30, "rank 0 and its child to be gone")


def test_ranks_die_with_a_sigkilled_supervisor(pid_dir: Path, procs: list[Any]) -> None:
    code = f"""
import os, time
path = {str(pid_dir)!r} + "/pid-" + os.environ["LOCAL_RANK"]
open(path + ".tmp", "w").write(str(os.getpid()))
os.rename(path + ".tmp", path)
time.sleep(600)
"""
    s = start(procs, ["--ranks=2", "--", *rank(code)])
    wait_for_files(s, [pid_dir / "pid-0", pid_dir / "pid-1"], "both ranks to run")
    rank_pids = [int((pid_dir / f"pid-{k}").read_text()) for k in (0, 1)]
    s.proc.kill()
    s.wait()
    wait_for(lambda: not any(alive(p) for p in rank_pids), 30, "the ranks to die with their supervisor")


def pid_namespaces() -> bool:
    try:
        return subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True,
                              timeout=HANG_GUARD_S).returncode == 0  # fmt: skip
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not pid_namespaces(), reason="needs unshare --pid (root, util-linux)")
def test_as_pid_1_it_reaps_orphans(tmp_path: Path) -> None:
    # As in a container: the supervisor is PID 1 of its own PID namespace. A rank's child that outlives its parent
    # is re-parented to it, and must not stay a zombie once it exits.
    done = tmp_path / "orphan-done"
    code = f"""
import os, subprocess, time
subprocess.run(["sh", "-c", "(sleep 0.2; touch {done}) & exit 0"], check=True)
def state(pid):
    try:
        return open(f"/proc/{{pid}}/stat").read().rpartition(")")[2].split()[0]
    except OSError:
        return "gone"
def zombies():
    return [pid for pid in os.listdir("/proc") if pid.isdigit() and state(pid) == "Z"]
deadline = time.monotonic() + 30
while (not os.path.exists({str(done)!r}) or zombies()) and time.monotonic() < deadline:
    time.sleep(0.05)
print("zombies left:", zombies(), flush=True)
"""
    proc = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", *SUPERVISE, "--", *rank(code)], env=pod_env(),
                          capture_output=True, text=True, timeout=HANG_GUARD_S)  # fmt: skip
    assert proc.returncode == 0 and done.exists(), proc
    assert "[rank 0] zombies left: []" in proc.stdout.splitlines(), proc.stdout


# --- SIGTERM ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("codes", "expected"), [((0, 0), 0), ((0, 7), 7)])
def test_sigterm_is_forwarded_and_the_ranks_codes_are_the_pods(
    codes: tuple[int, int], expected: int, procs: list[Any]
) -> None:
    code = f"""
import os, signal, sys, time
k = int(os.environ["LOCAL_RANK"])
def stop(signum, frame):
    print(f"rank {{k}} saves and stops on {{signal.Signals(signum).name}}", flush=True)
    sys.exit({list(codes)!r}[k])
signal.signal(signal.SIGTERM, stop)
print("ready", flush=True)
time.sleep(600)
"""
    s = start(procs, ["--ranks=2", "--", *rank(code)])
    wait_for(lambda: all(s.rank_lines(r) == ["ready"] for r in (0, 1)), 60, "both ranks to handle SIGTERM")
    s.proc.send_signal(signal.SIGTERM)
    assert s.wait() == expected, s.output()
    for r in (0, 1):
        assert s.rank_lines(r)[-1] == f"rank {r} saves and stops on SIGTERM", s.output()


def test_a_rank_still_running_after_the_grace_is_sigkilled(pid_dir: Path, procs: list[Any]) -> None:
    code = f"""
import os, signal, sys, time
k = os.environ["LOCAL_RANK"]
signal.signal(signal.SIGTERM, signal.SIG_IGN if k == "0" else lambda *_: sys.exit(0))
path = {str(pid_dir)!r} + "/pid-" + k
open(path + ".tmp", "w").write(str(os.getpid()))
os.rename(path + ".tmp", path)
time.sleep(600)
"""
    s = start(procs, ["--ranks=2", "--", *rank(code)], pod_env(**{supervisor.ENV_SUPERVISE_GRACE_S: "1"}))
    wait_for_files(s, [pid_dir / "pid-0", pid_dir / "pid-1"], "both ranks to set their SIGTERM handling")
    s.proc.send_signal(signal.SIGTERM)
    assert s.wait() == 128 + signal.SIGTERM, s.output()
    assert "[supervise] grace of 1s over: SIGKILL rank(s) 0" in s.lines, s.output()
    assert not alive(int((pid_dir / "pid-0").read_text()))


# --- output -----------------------------------------------------------------------------------------------------
def test_output_lines_are_prefixed_whole_and_never_interleaved(procs: list[Any]) -> None:
    # Each line is written in two flushed halves, so a supervisor forwarding what it reads instead of whole lines
    # would cut them; the last line has no newline.
    lines, width = 1500, 300
    code = f"""
import os, sys
r = os.environ["RANK"]
for i in range({lines}):
    sys.stdout.write(f"{{r}}:{{i}}:" + "x" * {width // 2}); sys.stdout.flush()
    sys.stderr.write("x" * {width // 2} + "\\n"); sys.stderr.flush()
sys.stdout.write(f"{{r}}:end")
"""
    s = start(procs, ["--ranks=4", "--", *rank(code)])
    assert s.wait() == 0, "\n".join(s.lines[-20:])
    pattern = re.compile(rf"\[rank (\d)\] (\d):(\d+|end)(:x{{{width}}})?")
    seen: dict[str, list[str]] = {str(r): [] for r in range(4)}
    for line in s.lines:
        if line.startswith("[supervise] "):
            continue
        m = pattern.fullmatch(line)
        assert m and m[1] == m[2] and (m[3] == "end") == (m[4] is None), f"torn or mixed line: {line[:200]!r}"
        seen[m[1]].append(m[3])
    for r, got in seen.items():
        assert got == [*map(str, range(lines)), "end"], f"rank {r}: {len(got)} lines"


# --- failures to start ------------------------------------------------------------------------------------------
def test_a_command_that_does_not_exist_exits_127(tmp_path: Path) -> None:
    proc = subprocess.run([*SUPERVISE, "--ranks=2", "--", str(tmp_path / "no-such-command")], env=pod_env(),
                          capture_output=True, text=True, timeout=HANG_GUARD_S)  # fmt: skip
    assert proc.returncode == 127, proc
    assert proc.stderr.count("\n") == 1 and "no-such-command" in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    ("args", "env", "names"),
    [
        (["--ranks=0"], {}, ["--ranks", "FTJOB_RANKS_PER_POD"]),
        (["--ranks=two"], {}, ["--ranks", "FTJOB_RANKS_PER_POD"]),
        ([], {"FTJOB_RANKS_PER_POD": str(contract.MAX_RANKS_PER_POD + 1)}, ["--ranks", "FTJOB_RANKS_PER_POD"]),
        ([], {"FTJOB_RANKS_PER_POD": "many"}, ["--ranks", "FTJOB_RANKS_PER_POD"]),
        (["--ranks=2"], {"WORLD_SIZE": "3"}, ["WORLD_SIZE", "--ranks"]),
        (["--ranks=2"], {"FTJOB_POD_RANK": "1", "WORLD_SIZE": "2"}, ["WORLD_SIZE", "FTJOB_POD_RANK"]),
        (["--ranks=2"], {"FTJOB_POD_RANK": "first"}, ["FTJOB_POD_RANK"]),
        (["--ranks=2"], {"FTJOB_METRICS_PORT": "65500"}, ["FTJOB_METRICS_PORT"]),
        (["--grace-seconds=soon"], {}, ["--grace-seconds", "FTJOB_SUPERVISE_GRACE_S"]),
        ([], {"FTJOB_SUPERVISE_GRACE_S": "-5"}, ["--grace-seconds", "FTJOB_SUPERVISE_GRACE_S"]),
        (["--bind=gpu"], {}, ["--bind"]),
    ],
)
def test_bad_arguments_fail_in_one_line_before_any_rank_starts(
    args: list[str], env: dict[str, str], names: list[str], tmp_path: Path
) -> None:
    marker = tmp_path / "started"
    command = rank(f"open({str(marker)!r}, 'w')")
    proc = subprocess.run([*SUPERVISE, *args, "--", *command], env=pod_env(**env), capture_output=True, text=True,
                          timeout=HANG_GUARD_S)  # fmt: skip
    assert proc.returncode == 2, proc
    assert proc.stderr.startswith("ftjob-trainer supervise: error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert all(n in proc.stderr for n in names), proc.stderr
    assert not marker.exists()


def test_the_command_goes_after_a_double_dash() -> None:
    proc = subprocess.run([*SUPERVISE, "--ranks=2"], env=pod_env(), capture_output=True, text=True,
                          timeout=HANG_GUARD_S)  # fmt: skip
    assert proc.returncode == 2 and "after --" in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


def test_the_supervisor_imports_no_torch() -> None:
    # It is PID 1 of every multi-rank pod: torch would cost its memory once more per pod, and start-up time.
    code = (
        "import sys; from ftjob.cli import main; rc = main(['supervise', '--', 'true']); "
        "print(rc, sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=pod_env(), capture_output=True, text=True,
                          timeout=HANG_GUARD_S)  # fmt: skip
    assert proc.stdout.splitlines()[-1] == "0 []", proc
