"""ftjob.ft.gc_freeze: loading the library freezes what the process loaded so far (torch above all) out of CPython's
full collections, which otherwise rescan it over and over while a replacement rank starts (it slows a rejoin).
Each case runs in a fresh interpreter: freezing is process-wide."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from ftjob import contract

PROBE = textwrap.dedent("""
    import atexit, gc, json, sys, weakref
    # registered before ftjob's own handler, so it runs after it (atexit is last-in, first-out)
    atexit.register(lambda: print(json.dumps({"frozen_at_exit": gc.get_freeze_count()}), flush=True))

    class Node:
        pass

    import torch
    early = Node()
    early.me = early  # a cycle alive when the library loads
    early_ref = weakref.ref(early)
    import ftjob.ft
    after_package = gc.get_freeze_count()
    from ftjob.ft.step.manager import Manager
    after_manager = gc.get_freeze_count()
    late = Node()
    late.me = late  # a cycle the training script makes afterwards
    late_ref = weakref.ref(late)
    del early, late
    gc.collect()
    print(json.dumps({"after_package": after_package, "after_manager": after_manager,
                      "early_cycle_kept": early_ref() is not None, "late_cycle_freed": late_ref() is None}))
""")


def probe(**env: str) -> dict[str, object]:
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})  # fmt: skip
    assert done.returncode == 0, done.stderr
    found: dict[str, object] = {}
    for line in done.stdout.splitlines():
        found |= json.loads(line)
    return found


def test_loading_the_library_freezes_what_is_loaded_and_unfreezes_at_exit() -> None:
    got = probe(**{contract.ENV_GC_FREEZE: "1"})
    assert isinstance(got["after_package"], int) and got["after_package"] > 50_000, f"torch's objects frozen: {got}"
    assert isinstance(got["after_manager"], int) and got["after_manager"] > got["after_package"], (
        f"the Manager's own dependencies (aiohttp, pydantic, ...) frozen too: {got}"
    )
    assert got["early_cycle_kept"], "a cycle alive at import is frozen: no collection scans it"
    assert got["late_cycle_freed"], "what the script creates later is collected as usual"
    assert got["frozen_at_exit"] == 0, "unfrozen at exit: the interpreter's last collection frees it all"


def test_the_switch_leaves_the_collector_alone() -> None:
    got = probe(**{contract.ENV_GC_FREEZE: "0"})
    assert got["after_package"] == 0 and got["after_manager"] == 0, got
    assert not got["early_cycle_kept"], "nothing frozen: a full collection frees the old cycle"
