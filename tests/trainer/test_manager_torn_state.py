"""A heal that fails after writing into the healer's own tensors (recovery receives in place) leaves a torn state: the
group heals again while a peer is ahead, and once no peer is ahead it exits with StateLostError rather than train or
serve the torn state. One group is a worker process; the healer is a Manager in this process, against a real
lighthouse. The failure is injected into the heal's fetch: it writes garbage into the template, then raises."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from ftjob.ft.step.manager import Manager

from tests.support.local_job import TOKEN, Lighthouse, Worker
from tests.support.polling import wait_for

TIMEOUT = 120
WIDTH = 16  # tests/support/manager_worker.py's default model: two nn.Linear(16, 16), Adam, a data cursor


def torn_healer(
    tmp_path: Path, procs: list, monkeypatch: Any
) -> tuple[Lighthouse, Worker, Manager, Callable, torch.nn.Module]:
    """Group 0 trains ahead; group 1 (here) joins, and its first heal fails after tearing its state. Also returns
    group 1's model: what the Manager heals into."""
    import ftjob.ft.step.manager as manager_module
    from ftjob.ft.recovery.transport import RecoveryError
    from ftjob.ft.step.manager import ManagerConfig

    real_fetch, failures = manager_module.fetch_state, [1]

    def tearing_fetch(*args: Any, **kwargs: Any) -> Any:
        if failures[0]:
            failures[0] -= 1
            with torch.no_grad():
                for p in model.parameters():  # part of the peer's state landed, then the peer went away
                    p.fill_(float("nan"))
            raise RecoveryError("injected: the peer closed the connection in the middle of a chunk")
        return real_fetch(*args, **kwargs)

    monkeypatch.setattr(manager_module, "fetch_state", tearing_fetch)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, WIDTH))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = {"cursor": 0}

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": opt.state_dict(), "data": dict(data)}

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        data.update(state["data"])

    lh = Lighthouse(tmp_path, "--min-replicas", "1", "--join-timeout", "0.2").start()
    procs.append(lh)
    ahead = Worker(tmp_path, lh.url, "0", "--steps", "3000", "--step-delay", "0.05")
    procs.append(ahead)
    wait_for(lambda: ahead.last_step() >= 3, TIMEOUT, "group 0 to train ahead")
    cfg = ManagerConfig(group="1", lighthouse_url=lh.url, token=TOKEN, quorum_timeout_s=60)
    mgr = Manager(cfg, state_dict, load_state_dict)

    def step() -> bool:
        mgr.start_quorum()
        model(torch.randn(8, WIDTH)).pow(2).mean().backward()
        mgr.allreduce_gradients(model.parameters())
        committed = mgr.should_commit()
        if committed:
            opt.step()
        opt.zero_grad()
        return committed

    assert not step() and mgr.step == 0 and mgr.metrics["heals"] == 0  # the torn heal: nothing committed
    assert all(torch.isnan(p).all() for p in model.parameters())
    return lh, ahead, mgr, step, model


def test_a_torn_state_heals_again_from_the_peer_ahead(tmp_path: Path, procs: list, monkeypatch):
    _, _, mgr, step, model = torn_healer(tmp_path, procs, monkeypatch)
    try:
        wait_for(lambda: step() and mgr.metrics["heals"] == 1, TIMEOUT, "a whole heal and a commit")
        assert mgr.step > 3 and all(torch.isfinite(p).all() for p in model.parameters())
    finally:
        mgr.shutdown()


def test_a_torn_state_with_no_peer_ahead_exits_instead_of_training(tmp_path: Path, procs: list, monkeypatch):
    """Group 0 and the lighthouse are lost together; a blank lighthouse on the same address knows no committed step,
    so group 1, torn, would be the job's most advanced group: it must exit (its replacement restores the checkpoint)."""
    from ftjob.ft.step.manager_types import StateLostError

    lh, ahead, mgr, step, _ = torn_healer(tmp_path, procs, monkeypatch)
    try:
        ahead.kill()
        lh.kill()
        lh.start()
        with pytest.raises(StateLostError):
            step()
    finally:
        mgr.shutdown()
