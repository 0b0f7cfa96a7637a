"""The cross-group process group of one rank: rank i of every group in the quorum, rebuilt only when the quorum id
changes, and collectives that can be abandoned (timeout or an abort signal) without blocking the training thread.

Why the graveyard: a gloo process group whose collective hangs cannot be cancelled (``abort()`` does not wake the
pending work), and dropping its last reference blocks in the destructor until its own timeout. So an abandoned group
is handed to a reaper thread that drops it there; the training thread moves on to a fresh group at once.
"""

from __future__ import annotations

import datetime
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger("ftjob.process_group")


class CollectiveError(RuntimeError):
    """A cross-group collective (or the group's construction) failed, timed out or was aborted."""


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` (an IPv6 host in brackets or not) as (host, port)."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


class CrossGroupPG:
    """The process group across the replica groups, one per quorum: this rank with the same rank of every other
    group in the quorum. Rebuilt when the quorum changes; hosts the TCP store its peers meet in when its group is
    the quorum's first; abandoned collectives are aborted on a reaper thread."""

    def __init__(
        self,
        rank_in_group: int,
        advertise_addr: str,
        store_port: int,
        device: str,
        timeout_s: float,
    ) -> None:
        self.rank_in_group = rank_in_group
        self.device = device
        self.timeout_s = timeout_s
        self._timeout = datetime.timedelta(seconds=timeout_s)
        # This rank hosts the store its peers meet in whenever its group is the quorum's first member.
        self._server = dist.TCPStore(
            advertise_addr, store_port, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=30)
        )
        self.store_address = f"{advertise_addr}:{self._server.port}"
        self._clients: dict[str, dist.TCPStore] = {self.store_address: self._server}
        self._pg: Any = None
        self.quorum_id: int | None = None
        self.replica_rank = 0
        self.world = 1
        self.rebuilds = 0
        self._wake = threading.Event()
        self._graveyard: queue.Queue[Any] = queue.Queue()
        self._reaper = threading.Thread(target=self._reap, name="pg-reaper", daemon=True)
        self._reaper.start()

    # --- lifecycle -----------------------------------------------------------------------------------------------
    def _reap(self) -> None:
        while True:
            item = self._graveyard.get()
            if item is None:
                return
            pg = item[0]
            try:
                if pg is not None:
                    pg.abort()  # NCCL: cancels the hung kernels; gloo: harmless, its work ends at its own timeout
            except Exception:
                pass
            del item, pg  # may block until the abandoned collective times out: fine, this is the reaper thread

    def retire(self, pending: Any = None) -> None:
        """Forgets the current group (never reused); a hung one is dropped on the reaper thread."""
        if self._pg is not None:
            self._graveyard.put((self._pg, pending))
        self._pg = None
        self.quorum_id = None

    def abandon(self, works: list[Any]) -> None:
        """Hands started work of an already retired group to the reaper: dropping it may block."""
        if works:
            self._graveyard.put((None, works))

    def close(self) -> None:
        """Releases every group; waits (bounded by the collective timeout) for abandoned ones to wind down, since
        a process exiting while a gloo group is being destroyed aborts with std::terminate."""
        self.retire()
        self._graveyard.put(None)
        self._reaper.join(self.timeout_s + 1.0)

    def interrupt(self) -> None:
        """Wakes a collective or construction waiting in this rank (the caller's abort check then decides)."""
        self._wake.set()

    def _store(self, address: str) -> dist.TCPStore:
        client = self._clients.get(address)
        if client is None:
            host, port = split_address(address)
            client = dist.TCPStore(host, port, is_master=False, timeout=self._timeout)
            self._clients[address] = client
        return client

    def _new_group(self, store: dist.Store, replica_rank: int, world: int) -> Any:
        if self.device.startswith("cuda"):
            return dist.ProcessGroupNCCL(store, replica_rank, world, self._timeout)
        return dist.ProcessGroupGloo(store, replica_rank, world, self._timeout)

    def configure(
        self,
        quorum_id: int,
        store_address: str,
        store_prefix: str,
        replica_rank: int,
        world: int,
        should_abort: Callable[[], bool],
    ) -> bool:
        """Makes the group of this quorum current; returns True if it had to be rebuilt. Raises CollectiveError."""
        if quorum_id == self.quorum_id and (self._pg is not None or world == 1):
            return False
        self.retire()
        self.replica_rank, self.world = replica_rank, world
        if world == 1:  # alone in the quorum: nothing to talk to
            self.quorum_id = quorum_id
            self.rebuilds += 1
            return True
        holder: dict[str, Any] = {}
        done = threading.Event()
        self._wake.clear()

        def build() -> None:
            try:
                prefix = f"{store_prefix}/r{self.rank_in_group}"
                store = dist.PrefixStore(prefix, self._store(store_address))
                holder["pg"] = self._new_group(store, replica_rank, world)
            except Exception as e:
                holder["error"] = e
            finally:
                done.set()
                self._wake.set()
                if holder.get("abandoned") and "pg" in holder:
                    self._graveyard.put((holder.pop("pg"), None))

        # Construction blocks until every peer shows up: run it aside so an abort signal is not ignored meanwhile.
        threading.Thread(target=build, name=f"pg-build-q{quorum_id}", daemon=True).start()
        deadline = time.monotonic() + self.timeout_s
        while not done.is_set():
            if should_abort() or time.monotonic() >= deadline:
                holder["abandoned"] = True
                if done.is_set() and "pg" in holder:
                    self._graveyard.put((holder.pop("pg"), None))
                why = "aborted by the lighthouse" if should_abort() else f"timed out after {self.timeout_s}s"
                raise CollectiveError(f"building the process group of quorum {quorum_id} {why}")
            self._wake.wait(max(0.0, deadline - time.monotonic()))
            self._wake.clear()
        if "error" in holder:
            raise CollectiveError(f"building the process group of quorum {quorum_id} failed: {holder['error']}")
        self._pg = holder["pg"]
        self.quorum_id = quorum_id
        self.rebuilds += 1
        return True

    # --- collectives ---------------------------------------------------------------------------------------------
    def allreduce_sum(self, buckets: list[torch.Tensor], should_abort: Callable[[], bool]) -> None:
        """Sums each bucket in place across the quorum; one collective per bucket, all in flight at once.

        Raises CollectiveError on failure, timeout or abort; the group is then retired (the caller's buckets may
        still be written by the abandoned collective: never reuse them)."""
        self.allreduce_wait([self.allreduce_start(b) for b in buckets], should_abort)

    def allreduce_start(self, bucket: torch.Tensor) -> Any:
        """Starts summing one bucket in place across the quorum (None when this group is alone)."""
        if self.world == 1:
            return None
        if self._pg is None:
            raise CollectiveError("no process group for this quorum (its construction failed)")
        try:
            return self._pg.allreduce([bucket])
        except Exception as e:
            self.retire()
            raise CollectiveError(f"all-reduce could not start: {e}") from e

    def allreduce_wait(self, works: list[Any], should_abort: Callable[[], bool]) -> None:
        """Waits for started all-reduces, bounded by the collective timeout and woken by an abort signal."""
        works = [w for w in works if w is not None]
        if all(w.is_completed() for w in works):  # done already (or nothing to wait for): no callbacks, no wake-up
            self._check(works)
            return
        self._wake.clear()
        pending = [len(works)]
        lock = threading.Lock()

        def one_done(_fut: Any) -> None:
            with lock:
                pending[0] -= 1
                if pending[0] == 0:
                    self._wake.set()

        for w in works:
            w.get_future().add_done_callback(one_done)
        deadline = time.monotonic() + self.timeout_s
        while True:
            with lock:
                finished = pending[0] == 0
            if finished:
                break
            if should_abort():
                self.retire(works)
                raise CollectiveError("all-reduce aborted: the lighthouse dropped a member of this quorum")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.retire(works)
                raise CollectiveError(f"all-reduce timed out after {self.timeout_s}s")
            self._wake.wait(remaining)
            self._wake.clear()
        self._check(works)

    def allgather(self, row: torch.Tensor, should_abort: Callable[[], bool]) -> torch.Tensor:
        """Every member's ``row``, stacked in replica-rank order. Unlike the rows of a summed table, each row here
        comes from its own member alone: nobody can write into another's. Raises CollectiveError as the others."""
        if self.world == 1:
            return row.unsqueeze(0).clone()
        if self._pg is None:
            raise CollectiveError("no process group for this quorum (its construction failed)")
        rows = [torch.empty_like(row) for _ in range(self.world)]
        try:
            work = self._pg.allgather([rows], [row])
        except Exception as e:
            self.retire()
            raise CollectiveError(f"all-gather could not start: {e}") from e
        self.allreduce_wait([work], should_abort)
        return torch.stack(rows)

    def _check(self, works: list[Any]) -> None:
        for w in works:
            try:
                w.wait()  # completed: raises the collective's error, if any
            except Exception as e:
                self.retire(works)
                raise CollectiveError(f"all-reduce failed: {e}") from e
