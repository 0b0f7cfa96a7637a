"""The per-rank fault-tolerance manager: joins the lighthouse's quorum every step, heals from a peer when behind,
averages gradients across the quorum's groups, and commits a step only when every rank of the group agrees.

Step protocol (see trainer/contract.py for the lighthouse API):
  start_quorum()          rank 0 asks the lighthouse; the group learns the answer; the cross-group process group is
                          rebuilt only if the quorum id changed; a group behind max_step copies model, optimizer and
                          data position from the named peer (rank i from rank i) and applies it on this thread.
  allreduce_gradients()   grads summed across the quorum in flat buckets and divided by the contributors; a spare or
                          healing group sends zeros and receives the average. Failures are recorded, never raised.
                          With register_params() (one rank per group) the buckets' all-reduces already start
                          during the backward pass; this call then only waits for them.
  should_commit()         unanimous vote inside the group; the step counter moves only on a commit.
  prefetch_quorum()       optional, after a commit: asks for the next step's quorum while the optimizer steps.
Failures never block longer than ``collective_timeout_s``, and the lighthouse's abort signal (a member evicted,
timed out or disconnected) wakes a pending collective at once.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from ftjob.trainer.grad_buckets import BackwardLauncher, flatten, plan_buckets, unflatten_into
from ftjob.trainer.lighthouse_client import EvictedError, LighthouseClient, LighthouseError
from ftjob.trainer.manager_group import InGroup
from ftjob.trainer.process_group import CollectiveError, CrossGroupPG
from ftjob.trainer.recovery import RecoveryError, RecoveryServer, fetch_state
from ftjob.trainer.recovery_codec import CodecError, local_part

log = logging.getLogger("ftjob.manager")


@dataclass
class ManagerConfig:
    group: str  # replica group id ("0", "1", ...)
    lighthouse_url: str
    token: str
    advertise_addr: str = "127.0.0.1"  # IP peers use to reach this rank's recovery server / store
    rank: int = 0  # rank inside the group (torch.distributed default group when world_size > 1)
    world_size: int = 1
    min_replicas: int = 1
    collective_timeout_s: float = 5.0  # bound on one cross-group collective
    quorum_timeout_s: float = 60.0
    recovery_port: int = 0  # 0 = ephemeral
    store_port: int = 0  # 0 = ephemeral
    device: str = "cpu"  # "cuda" -> NCCL across groups (with pinned-memory recovery staging), else gloo
    heartbeat_interval_s: float = 0.1
    bucket_bytes: int = 4 * 1024 * 1024  # gradient bucket size: one collective per bucket (the first is 1 MiB)
    recovery_parallelism: int = 4  # concurrent chunk requests while healing


@dataclass(frozen=True)
class QuorumInfo:
    quorum_id: int
    step: int  # the step this quorum trains (== manager.step after any healing)
    contributing: bool  # False for a spare or a healing group: it sends zero gradients and is not counted
    contributor_rank: int  # index among contributing groups (for data sharding); -1 when not contributing
    num_contributors: int  # gradient divisor / number of data shards this step
    participants: int  # groups in the quorum (contributing or not)
    healed: bool  # this call copied state from a peer


class QuorumUnavailable(RuntimeError):
    """No quorum within quorum_timeout_s (lighthouse unreachable or too few groups): the process should exit."""


def param_digest(tensors: Iterable[torch.Tensor]) -> str:
    """sha256 over the bytes of the tensors (local shards for DTensors): equal digests = bitwise-equal params."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(local_part(t).detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class Manager:
    def __init__(
        self,
        cfg: ManagerConfig,
        state_dict: Callable[[], dict[str, Any]],
        load_state_dict: Callable[[dict[str, Any]], None],
    ) -> None:
        self.cfg = cfg
        self._state_dict = state_dict
        self._load_state_dict = load_state_dict
        self.step = 0
        self.metrics: dict[str, float] = dict.fromkeys(
            ("quorums", "pg_rebuilds", "heals", "heal_seconds", "commits", "failed_commits", "aborted_collectives"), 0
        )
        self.metrics["recovery_chunk_retries"] = 0
        self.last_error: str | None = None  # why the last step failed (for logs)
        self._group = InGroup(cfg.rank, cfg.world_size)
        self._pg = CrossGroupPG(cfg.rank, cfg.advertise_addr, cfg.store_port, cfg.device, cfg.collective_timeout_s)
        self._recovery = RecoveryServer(cfg.token, cfg.advertise_addr, cfg.recovery_port)
        endpoints = self._group.all_gather_json([self._recovery.address, self._pg.store_address])
        self._addresses = [e[0] for e in endpoints]
        self._store_addresses = [e[1] for e in endpoints]
        self.incarnation = self._group.broadcast_json(uuid.uuid4().hex[:16])
        self._client = LighthouseClient(
            cfg.lighthouse_url,
            cfg.token,
            cfg.group,
            self.incarnation,
            rank=cfg.rank,
            heartbeat_interval_s=cfg.heartbeat_interval_s,
            on_abort=self._on_abort,
        ).start()
        self._quorum_id = -1  # last quorum id seen (reported so a restarted lighthouse keeps ids increasing)
        self._inflight: int | None = None  # quorum id of the step in progress
        self._info: QuorumInfo | None = None
        self._step_error: str | None = None
        self._commit_failures = 0
        self._last_heal_s: float | None = None
        self._layout: tuple[list[int], list[list[int]]] | None = None  # (param ids, buckets)
        self._launcher: BackwardLauncher | None = None
        self._prefetched: concurrent.futures.Future[dict[str, Any]] | None = None  # next step's quorum request

    def register_params(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Lets the all-reduce of each gradient bucket start during the backward pass (hooks on ``params``, which
        must be the list later given to allreduce_gradients, with one backward per step). A no-op for sharded
        groups (world_size > 1): FSDP2 reduces inside the group only after the backward."""
        if self.cfg.world_size > 1 or self._launcher is not None:
            return
        params = [p for p in params if p.requires_grad]
        self._launcher = BackwardLauncher(params, self._buckets(params))

    def _buckets(self, params: list[torch.nn.Parameter]) -> list[list[int]]:
        ids = [id(p) for p in params]
        if self._layout is None or self._layout[0] != ids:
            self._layout = (ids, plan_buckets(params, self.cfg.bucket_bytes))
        return self._layout[1]

    # --- abort signal ------------------------------------------------------------------------------------------
    def _should_abort(self) -> bool:
        return self._inflight is not None and self._inflight < self._client.abort_below

    def _on_abort(self, _abort_below: int) -> None:  # lighthouse client thread
        if self._should_abort():
            self._pg.interrupt()

    # --- step protocol -----------------------------------------------------------------------------------------
    def _quorum_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "group": self.cfg.group,
            "incarnation": self.incarnation,
            "step": self.step,
            "quorum_id": self._quorum_id,
            "commit_failures": self._commit_failures,
            "address": self._addresses[0],
            "store_address": self._store_addresses[0],
            "addresses": self._addresses,
            "store_addresses": self._store_addresses,
            "world_size": self.cfg.world_size,
        }
        if self._last_heal_s is not None:
            body["heal_seconds"] = self._last_heal_s
        return body

    def prefetch_quorum(self) -> None:
        """Sends the next step's quorum request now (right after a commit), so its round-trip overlaps the
        optimizer step instead of opening the next step; start_quorum() then collects the answer."""
        if self.cfg.rank == 0 and self._prefetched is None:
            self._prefetched = self._client.quorum_async(self._quorum_body(), self.cfg.quorum_timeout_s)

    def _ask_lighthouse(self) -> dict[str, Any]:
        if self.cfg.rank != 0:
            return {}
        pending, self._prefetched = self._prefetched, None
        try:
            if pending is not None:
                answer = pending.result(self.cfg.quorum_timeout_s + 10)
            else:
                answer = self._client.quorum(self._quorum_body(), self.cfg.quorum_timeout_s)
            self._last_heal_s = None
            return answer
        except EvictedError as e:
            return {"error": str(e), "evicted": True}
        except (LighthouseError, TimeoutError) as e:
            return {"error": str(e)}

    def start_quorum(self) -> QuorumInfo:
        """Joins this step's quorum; heals first if behind. Raises EvictedError / QuorumUnavailable (exit)."""
        self._step_error = None
        q = self._group.broadcast_json(self._ask_lighthouse())
        if "error" in q:
            if q.get("evicted"):
                raise EvictedError(410, q["error"])
            raise QuorumUnavailable(f"group {self.cfg.group}: {q['error']}")
        self._quorum_id = self._inflight = q["quorum_id"]
        self.metrics["quorums"] += 1
        if q["serve_recovery"]:  # a healer copies from us: snapshot now, at the step boundary; served aside
            self._recovery.publish(self.step, self._state_dict())
        try:
            rank = self.cfg.rank
            rebuilt = self._pg.configure(
                q["quorum_id"],
                q["store_addresses"][rank],
                q["store_prefix"],
                q["replica_rank"],
                q["replica_world_size"],
                self._should_abort,
            )
            self.metrics["pg_rebuilds"] += int(rebuilt)
        except CollectiveError as e:
            self._fail(str(e))
        healed = self._heal(q) if q["heal"] else False
        contributing = bool(q["contributing"]) and not q["heal"]
        self._info = QuorumInfo(
            quorum_id=q["quorum_id"],
            step=self.step,
            contributing=contributing,
            contributor_rank=q["contributor_rank"] if contributing else -1,
            num_contributors=q["num_contributors"],
            participants=q["replica_world_size"],
            healed=healed,
        )
        if self._launcher is not None:
            overlap = contributing and self._step_error is None and self._pg.quorum_id == self._inflight
            if overlap and self._pg.world > 1:
                self._launcher.arm(self._pg.allreduce_start)
            else:
                self._launcher.disarm()
        return self._info

    def _heal(self, q: dict[str, Any]) -> bool:
        source = q["recover_from"]
        address = source["addresses"][self.cfg.rank]
        start = time.monotonic()
        error = None
        try:
            state, stats = fetch_state(
                address,
                q["max_step"],
                self.cfg.token,
                template=self._state_dict(),
                device=self.cfg.device,
                parallel=self.cfg.recovery_parallelism,
                timeout_s=self.cfg.quorum_timeout_s,
            )
            self.metrics["recovery_chunk_retries"] += stats.retries
            self._load_state_dict(state)  # on the caller's (training) thread, at the step boundary
        except (RecoveryError, CodecError, KeyError, RuntimeError, ValueError) as e:
            error = f"healing from group {source['group']} at {address} failed: {e}"
        if not self._group.all_true(error is None):  # every rank healed, or the group stays at its old step
            self._fail(error or "another rank of this group failed to heal")
            return False
        self.step = q["max_step"]
        self._client.step = self.step
        self._last_heal_s = time.monotonic() - start
        self.metrics["heals"] += 1
        self.metrics["heal_seconds"] += self._last_heal_s
        log.info(
            "group %s rank %d healed to step %d in %.3fs", self.cfg.group, self.cfg.rank, self.step, self._last_heal_s
        )
        return True

    def _fail(self, why: str) -> None:
        if self._step_error is None:
            self._step_error = why
            log.warning("group %s rank %d step %d fails: %s", self.cfg.group, self.cfg.rank, self.step, why)

    def allreduce_gradients(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Averages the gradients in place over the contributors (zeros from non-contributors)."""
        params = [p for p in params if p.requires_grad]
        info = self._info
        if info is None:
            raise RuntimeError("allreduce_gradients() called before start_quorum() for this step")
        if self._step_error is not None and self._pg.quorum_id != self._inflight:
            return  # no process group for this quorum: nothing to take part in
        if self._launcher is not None and self._launcher.armed:
            self._finish_overlapped(params, info.num_contributors)
            return
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [local_part(p.grad) for p in params]
        buckets = self._buckets(params)
        # A step that already failed (e.g. its heal) still takes part, sending zeros, so its peers are not left
        # waiting for a collective timeout; its own result is discarded by should_commit().
        if info.contributing and self._step_error is None:
            flats = [flatten([grads[i] for i in b]) for b in buckets]
        else:
            flats = [torch.zeros(sum(grads[i].numel() for i in b), dtype=grads[b[0]].dtype, device=grads[b[0]].device)
                     for b in buckets]  # fmt: skip
        try:
            self._pg.allreduce_sum(flats, self._should_abort)
        except CollectiveError as e:
            self.metrics["aborted_collectives"] += 1
            self._fail(str(e))
            return
        if self._step_error is not None:
            return
        for flat, b in zip(flats, buckets, strict=True):
            unflatten_into(flat, [grads[i] for i in b], info.num_contributors)

    def _finish_overlapped(self, params: list[torch.nn.Parameter], num_contributors: int) -> None:
        assert self._launcher is not None
        if [id(p) for p in params] != [id(p) for p in self._launcher.params]:
            raise RuntimeError("allreduce_gradients() got other parameters than register_params()")
        flats, works, error = self._launcher.finish()
        if error is None:
            try:
                self._pg.allreduce_wait(works, self._should_abort)
            except CollectiveError as e:
                error = e
        else:
            self._pg.abandon(works)  # some buckets never started: the group is already retired
        if error is not None:
            self.metrics["aborted_collectives"] += 1
            self._fail(str(error))
            return
        for flat, b in zip(flats, self._launcher.buckets, strict=True):
            unflatten_into(flat, [local_part(params[i].grad) for i in b], num_contributors)

    def should_commit(self) -> bool:
        """Unanimous vote of the group's ranks; True -> the caller steps the optimizer, and ``step`` moves on."""
        ok = self._info is not None and self._step_error is None
        if ok and self._info is not None and self._info.participants < self.cfg.min_replicas:
            self._fail(f"only {self._info.participants} groups in the quorum, min_replicas is {self.cfg.min_replicas}")
            ok = False
        ok = self._group.all_true(ok)
        if ok:
            self.step += 1
            self._commit_failures = 0
            self.metrics["commits"] += 1
        else:
            self._commit_failures += 1
            self.metrics["failed_commits"] += 1
            self.last_error = self._step_error or "another rank of this group could not commit"
        self._client.step = self.step
        self._info = None
        self._inflight = None
        if self._launcher is not None:
            self._launcher.disarm()
        return ok

    def report_finished(self, param_digest: str) -> None:
        """Tells the lighthouse this group trained its last step, with a digest of its parameters."""
        if self.cfg.rank == 0:
            self._client.heartbeat(self.step, finished=True, param_digest=param_digest)

    def shutdown(self) -> None:
        if self._prefetched is not None:
            self._prefetched.cancel()  # the lighthouse then forgets the request (its connection closes)
        self._client.close()
        self._recovery.close()
        self._pg.close()
