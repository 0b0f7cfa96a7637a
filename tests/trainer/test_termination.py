"""The SIGTERM watch (ftjob.ft.step.termination), in this process: installed only over the default action, never over a
handler of the script's own, while a Manager claims it; restored after the last claim; without a claim a SIGTERM
ends the process as it would without ftjob (in a subprocess)."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest
from ftjob import contract
from ftjob.ft.step.termination import SigtermWatch


@pytest.fixture(autouse=True)
def default_sigterm() -> Iterator[None]:
    """Every test starts from SIGTERM's default action and leaves this process's handler as it found it."""
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    signal.signal(signal.SIGTERM, previous)


def test_a_claim_installs_over_the_default_and_a_sigterm_only_sets_the_flag_until_the_last_release():
    watch = SigtermWatch()
    assert watch.claim() and watch.installed and not watch.requested()
    assert watch.claim()  # a second Manager in the process: nested
    signal.raise_signal(signal.SIGTERM)  # handled here: this test process lives on
    assert watch.requested()
    watch.release()
    assert watch.installed  # one Manager still runs
    watch.release()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_handler_of_the_script_s_own_is_left_alone():
    seen: list[int] = []

    def own(signum: int, _frame: object) -> None:
        seen.append(signum)

    signal.signal(signal.SIGTERM, own)
    watch = SigtermWatch()
    assert not watch.claim() and not watch.installed
    assert signal.getsignal(signal.SIGTERM) is own
    signal.raise_signal(signal.SIGTERM)
    assert seen == [signal.SIGTERM] and not watch.requested()
    watch.release()
    assert signal.getsignal(signal.SIGTERM) is own
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # an inherited "ignore" is the process's choice too
    assert not SigtermWatch().claim() and signal.getsignal(signal.SIGTERM) is signal.SIG_IGN


def test_off_the_main_thread_nothing_is_installed():
    watch = SigtermWatch()
    claimed: list[bool] = []
    worker = threading.Thread(target=lambda: claimed.append(watch.claim()))
    worker.start()
    worker.join()
    assert claimed == [False] and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_without_a_claim_a_sigterm_ends_the_process_at_once():
    """Claimed on the main thread, released on another (which cannot restore the default): the handler stays, but with
    no Manager to leave a job it ends the process as SIGTERM would have."""
    script = (
        "import os, signal, threading, time\n"
        "from ftjob.ft.step.termination import SigtermWatch\n"
        "w = SigtermWatch()\n"
        "assert w.claim()\n"
        "t = threading.Thread(target=w.release); t.start(); t.join()\n"
        "assert w.installed\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "time.sleep(30)\n"  # the signal's delivery, not a synchronisation: never reached when it works
        "print('still alive')\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode in (-signal.SIGTERM, contract.EXIT_TERMINATED), proc.stdout + proc.stderr
    assert "still alive" not in proc.stdout
