"""How one rank reaches the lighthouse: one connection per replica group. Rank 0 holds the group's LighthouseClient
(quorum requests, the watch socket: heartbeats up, abort signals down); the other ranks hear the aborts and report
their progress through the group link to rank 0 (ftjob.ft.links.group_link), so a job of N groups of M ranks keeps N
lighthouse connections, not N x M. A group of one rank has no link: no extra thread or socket.

Rank 0's heartbeats speak for the whole group: progress is the minimum of the ranks' counters (every rank bumps
its counter at the same protocol points) and ``waiting`` holds only while every rank waits in the step's collective.
When a rank's process dies, the group link drops: rank 0 leaves the lighthouse at once (its watch socket closes for
good, which the lighthouse takes as the group disconnecting) instead of letting the survivors wait for the heartbeat
timeout, and every rank fails its step (``lost``, then GroupLinkLost at the next quorum).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from ftjob.ft.links.group_link import LinkClient, LinkServer
from ftjob.ft.links.lighthouse_client import LighthouseClient
from ftjob.ft.step.manager_types import QuorumUnavailable

if TYPE_CHECKING:
    from ftjob.ft.step.manager import ManagerConfig

log = logging.getLogger("ftjob.control_plane")


class GroupLinkLost(QuorumUnavailable):
    """A rank of this replica group died (its group link dropped): the process exits and the group is replaced."""


class ControlPlane:
    """Built before the group exchanges its addresses (rank 0 of a group of several listens for the link then);
    ``connect()`` once the incarnation is known."""

    def __init__(self, cfg: ManagerConfig, on_abort: Callable[[int], None], on_reconnect: Callable[[], None]) -> None:
        """``on_abort``: called with every abort signal (lighthouse client or group link thread) and when the group
        is lost; ``on_reconnect``: rank 0's watch socket re-opened after a lost lighthouse."""
        self.cfg = cfg
        self._on_abort, self._on_reconnect = on_abort, on_reconnect
        self._client: LighthouseClient | None = None
        self._link: LinkClient | None = None
        self._progress = 0
        self.lost: str | None = None
        self._server: LinkServer | None = None
        if cfg.rank == 0 and cfg.world_size > 1:
            self._server = LinkServer(cfg.token, cfg.advertise_addr, cfg.world_size, self._group_progress, self._lost)

    @property
    def link_address(self) -> str:
        """Rank 0's group link address ("" elsewhere or in a group of one), for the group's address exchange."""
        return self._server.address if self._server is not None else ""

    def connect(self, link_address: str, incarnation: str) -> None:
        """Rank 0 connects to the lighthouse and waits for its group's links; a rank > 0 opens its link to rank 0."""
        cfg = self.cfg
        if cfg.rank > 0:
            self._link = LinkClient(link_address, cfg.token, cfg.rank, self._on_abort, self._lost)
            return
        self._client = LighthouseClient(
            cfg.lighthouse_url,
            cfg.token,
            cfg.group,
            incarnation,
            rank=0,
            generation=cfg.generation,
            heartbeat_interval_s=cfg.heartbeat_interval_s,
            on_abort=self._forward if self._server is not None else self._on_abort,
            lost_timeout_s=cfg.lost_timeout_s,
            on_reconnect=self._on_reconnect,
            tls=cfg.tls,
        ).start()
        if self._server is not None:
            self._server.wait_connected()

    @property
    def client(self) -> LighthouseClient:
        """Rank 0's lighthouse client (quorum requests, the final heartbeat)."""
        assert self._client is not None, "only rank 0 of a group talks to the lighthouse"
        return self._client

    @property
    def abort_below(self) -> int:
        """Quorums with a lower id must abort: what rank 0's lighthouse client heard, or what the group link
        forwarded."""
        if self._client is not None:
            return self._client.abort_below
        return self._link.abort_below if self._link is not None else 0

    def aborts(self, quorum_id: int) -> bool:
        """The step of quorum ``quorum_id`` must abort: the lighthouse said so, or this group lost a rank."""
        return quorum_id < self.abort_below or self.lost is not None

    def set_step(self, step: int) -> None:
        """The step rank 0 reports in its heartbeats (other ranks: nothing to do)."""
        if self._client is not None:
            self._client.step = step

    def progress(self, waiting: bool = False) -> None:
        """A protocol point of the step (stall detection); ``waiting``: now blocked in the cross-group collective."""
        self._progress += 1
        if self._server is not None:
            self._server.report(self._progress, waiting)
        elif self._link is not None:
            self._link.report(self._progress, waiting)
        elif self._client is not None:
            self._client.progress, self._client.waiting = self._progress, waiting

    def report_finished(self, step: int, param_digest: str) -> None:
        """Rank 0 tells the lighthouse the group trained its last step (the other ranks: nothing to do)."""
        if self._client is not None:
            self._client.heartbeat(step, finished=True, param_digest=param_digest, timeout_s=self.cfg.lost_timeout_s)

    def leave(self, step: int) -> None:
        """Rank 0 tells the lighthouse the group leaves the job for good after committing ``step`` (SIGTERM), then
        leaves it (the other ranks: nothing to do, they exit with it)."""
        if self._client is not None:
            self._client.leave(step)

    def check(self) -> None:
        """Raises GroupLinkLost once a rank of this group was lost."""
        if self.lost is not None:
            raise GroupLinkLost(f"group {self.cfg.group} rank {self.cfg.rank}: {self.lost}")

    # --- callbacks (lighthouse client thread, group link thread) --------------------------------------------------
    def _forward(self, abort_below: int) -> None:
        assert self._server is not None
        self._server.forward(abort_below)  # first: the other ranks wake while this one does
        self._on_abort(abort_below)

    def _group_progress(self, progress: int, waiting: bool) -> None:
        if self._client is not None:
            self._client.progress, self._client.waiting = progress, waiting

    def _lost(self, why: str) -> None:
        self.lost = why
        if self._client is not None:
            self._client.abandon(why)  # the lighthouse drops this group now: the survivors' steps abort
        self._on_abort(self.abort_below)  # wakes a pending collective (the Manager's abort check sees ``lost``)

    def close(self) -> None:
        """Closes the group link and the lighthouse client (whichever this rank holds)."""
        for part in (self._server, self._link, self._client):
            if part is not None:
                part.close()
