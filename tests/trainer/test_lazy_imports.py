"""A restarted group's startup imports only what it needs before it rejoins (its rejoin time): ``ftjob.ft``
loads its public names on first use, so the Manager path does not pull in the wrappers, data loading or durable
checkpointing modules."""

from __future__ import annotations

import json
import subprocess
import sys

import ftjob.ft as ft

# Modules the Manager's path (tests/support/manager_worker.py, hack/bench/bench_failover.py) never needs.
NOT_ON_THE_MANAGER_PATH = {
    "wrappers.data",
    "wrappers.ddp",
    "wrappers.optim",
    "wrappers.sharding",
    "step.session",
    "setup",
    "recovery.job_checkpoint",
    "checkpoint",
}


def loaded_after(statement: str) -> set[str]:
    code = f"import json, sys\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return {m.removeprefix("ftjob.ft.") for m in json.loads(out) if m.startswith("ftjob.ft.")}


def test_manager_path_skips_the_wrappers() -> None:
    loaded = loaded_after(
        "from ftjob.ft.step.manager import Manager\nfrom ftjob.ft.integrity.digest import local_digest"
    )
    assert "step.manager" in loaded
    assert not loaded & NOT_ON_THE_MANAGER_PATH, sorted(loaded & NOT_ON_THE_MANAGER_PATH)


def test_package_import_loads_nothing_until_used() -> None:
    # gc_freeze only: importing the package freezes the heap the script loaded so far (tests/trainer/test_gc_freeze.py)
    assert loaded_after("import ftjob.ft") == {"gc_freeze"}


def test_every_public_name_resolves() -> None:
    for name in ft.__all__:
        assert getattr(ft, name) is not None, name
    from ftjob.ft import DataLoader, checkpoint, init  # names and submodules alike

    assert DataLoader is ft.DataLoader and init is ft.init and checkpoint.__name__ == "ftjob.ft.checkpoint"
    assert set(ft.__all__) <= set(dir(ft))
