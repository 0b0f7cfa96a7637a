"""One lighthouse connection per replica group (ftjob.ft.links.group_link, ftjob.ft.links.control_plane).

In-process: the link forwards rank 0's aborts, folds the ranks' progress, refuses a wrong token, and tells a dropped
rank from a clean goodbye. End to end (2 groups x 2 ranks, real lighthouse): only rank 0 of a group holds a
connection to the lighthouse, yet the lighthouse's abort interrupts rank 1's pending collective; killing rank 1 makes
the lighthouse drop the group as disconnected, long before its (600 s) heartbeat timeout.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
from pathlib import Path

import pytest
from ftjob import contract
from ftjob.contract.lighthouse_api import DroppedEvent
from ftjob.ft.links.control_plane import ControlPlane
from ftjob.ft.links.group_link import LinkClient, LinkServer
from ftjob.ft.step.manager import ManagerConfig
from test_manager_hsdp import TIMEOUT, start_group

from tests.support.local_job import Lighthouse, Worker
from tests.support.polling import wait_for

TOKEN = "link-token"


class Group:
    """A LinkServer and its LinkClients in this process, recording what each side hears."""

    def __init__(self, world: int) -> None:
        self.folded: list[tuple[int, bool]] = []
        self.lost: dict[int, str] = {}
        self.aborts: dict[int, list[int]] = {r: [] for r in range(1, world)}
        self.server = LinkServer(TOKEN, "127.0.0.1", world, self._fold, lambda why: self.lost.__setitem__(0, why))
        self.clients = {r: self._client(r) for r in range(1, world)}
        self.server.wait_connected(10)

    def _fold(self, progress: int, waiting: bool) -> None:
        self.folded.append((progress, waiting))

    def _client(self, rank: int) -> LinkClient:
        return LinkClient(
            self.server.address,
            TOKEN,
            rank,
            lambda below: self.aborts[rank].append(below),
            lambda why: self.lost.__setitem__(rank, why),
        )

    def close(self) -> None:
        for c in self.clients.values():
            c.close()
        self.server.close()


@pytest.fixture
def group3():
    g = Group(3)
    yield g
    g.close()


def test_link_forwards_aborts_and_folds_progress(group3: Group):
    group3.server.forward(7)
    wait_for(lambda: all(a == [7] for a in group3.aborts.values()), 10, "the abort to reach ranks 1 and 2")
    assert all(c.abort_below == 7 for c in group3.clients.values())
    group3.server.report(5, True)
    group3.clients[1].report(4, True)
    group3.clients[2].report(6, True)
    wait_for(lambda: group3.folded and group3.folded[-1] == (4, True), 10, "min progress, every rank waiting")
    group3.clients[1].report(9, False)
    wait_for(lambda: group3.folded[-1] == (5, False), 10, "one rank no longer waiting")
    assert not group3.lost


def test_link_refuses_a_wrong_token():
    server = LinkServer(TOKEN, "127.0.0.1", 2, lambda _p, _w: None, lambda _w: None)
    try:
        with pytest.raises(ConnectionError, match="refused the group link"):
            LinkClient(server.address, "wrong", 1, lambda _b: None, lambda _w: None)
        with pytest.raises(ConnectionError, match="did not open"):
            server.wait_connected(0.2)
    finally:
        server.close()


def test_a_dropped_rank_is_lost_on_every_rank_but_a_goodbye_is_not(group3: Group):
    group3.clients[2].close()  # a clean goodbye: nobody is lost
    group3.server.forward(3)
    wait_for(lambda: group3.aborts[1] == [3], 10, "rank 1 to hear the abort")
    assert not group3.lost
    group3.clients[1]._sock.shutdown(socket.SHUT_RDWR)  # rank 1's process dies: its socket closes, no goodbye
    wait_for(lambda: 0 in group3.lost, 10, "rank 0 to notice rank 1's link drop")
    assert "rank 1" in group3.lost[0]
    wait_for(lambda: 1 in group3.lost, 10, "rank 1 to see its own link drop")


def test_rank_0_closing_cleanly_loses_nobody(group3: Group):
    group3.server.close()
    wait_for(lambda: not any(c.reading for c in group3.clients.values()), 10, "the readers to stop")
    assert not group3.lost


# --- end to end ----------------------------------------------------------------------------------------------------
def lighthouse_connections(pid: int, port: int) -> int:
    """Established TCP connections of process ``pid`` to local port ``port`` (from /proc: no extra dependency)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                remote_port, state, inode = int(cols[2].rsplit(":", 1)[1], 16), cols[3], cols[9]
                count += remote_port == port and state == "01" and inode in inodes
    return count


def test_only_rank_0_connects_yet_rank_1_hears_the_abort_and_a_dead_rank_drops_the_group(tmp_path: Path, procs):
    # min 2 groups; no heartbeat timeout nor stall rule within the test: only the abort path and the link act
    lh = Lighthouse(tmp_path, "--min-replicas", "2", "--heartbeat-timeout", "600", "--stall-floor-s", "600").start()
    procs.append(lh)
    args = ("--steps", "1000", "--collective-timeout", "150", "--quorum-timeout", "600")
    survivor = start_group(procs, tmp_path, lh.url, "0", *args, "--step-delay", "0.05")
    hanging = start_group(procs, tmp_path, lh.url, "1", *args, "--hang-at-step", "3")
    wait_for(lambda: all(w.events("hanging") for w in hanging), TIMEOUT, "group 1 to hang inside step 3")

    for ranks in (survivor, hanging):  # one lighthouse connection per group: rank 0's
        assert lighthouse_connections(ranks[0].proc.pid, lh.port) >= 1
        assert lighthouse_connections(ranks[1].proc.pid, lh.port) == 0

    code, body = lh.request("POST", contract.PATH_EVICT, {"groups": ["1"], "reason": "test: hung group"})
    assert code == 200, body

    def failed(w: Worker) -> dict | None:
        return next((e for e in w.events("step") if not e["committed"]), None)

    # rank 1 of group 0 waits on rank 1 of the hung group: only the abort relayed by its rank 0 can wake it early
    for rank, w in enumerate(survivor):
        step = wait_for(lambda w=w: failed(w), TIMEOUT, f"group 0 rank {rank} to fail the aborted step")
        assert "abort" in step["error"], step

    victim = survivor[1]
    victim.proc.send_signal(signal.SIGKILL)

    def dropped() -> bool:
        return any(isinstance(e, DroppedEvent) and e.group == "0" for e in lh.status().history)

    wait_for(dropped, TIMEOUT, "the lighthouse to drop group 0 after its rank 1 died")
    reasons = [e.reason for e in lh.status().history if isinstance(e, DroppedEvent) and e.group == "0"]
    assert reasons == ["disconnected"], reasons
    wait_for(lambda: survivor[0].proc.poll() is not None, TIMEOUT, "group 0 rank 0 to exit")
    assert "GroupLinkLost" in survivor[0].log.read_text()


def test_a_group_of_one_has_no_link():
    before = threading.active_count()
    cfg = ManagerConfig(group="0", lighthouse_url="http://127.0.0.1:1", token=TOKEN, tls=None)
    control = ControlPlane(cfg, lambda _b: None, lambda: None)
    assert control.link_address == "" and threading.active_count() == before
