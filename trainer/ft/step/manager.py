"""The per-rank fault-tolerance manager: joins the lighthouse's quorum every step, heals from a peer when behind,
averages gradients across the quorum's groups, and commits a step only when every rank of the group agrees.

Step protocol (the lighthouse API is ftjob.contract.lighthouse_api):
  start_quorum()          rank 0 asks the lighthouse; the group learns the answer; the cross-group process group is
                          rebuilt only if the quorum id changed; a group behind max_step copies model, optimizer and
                          data position from the named peer (rank i from rank i) and applies it on this thread. At
                          step 0 a group that started from scratch copies one reference group's state the same way
                          (``sync_at_start``), so no group trains from weights of its own.
  allreduce_gradients()   grads summed across the quorum in flat buckets and divided by the contributors; a spare or
                          healing group sends zeros and receives the average. Failures are recorded, never raised.
                          With register_params() (one rank per group) the buckets' all-reduces already start
                          during the backward pass; this call then only waits for them.
  should_commit()         unanimous vote inside the group, with the gradient guard's verdict on every group's whole
                          gradient (ftjob.ft.integrity.guard; with its sketch check, on norms every group checked
                          against the sum): a refused step fails in every group. The step moves on a commit.
  prefetch_quorum()       optional, after a commit: asks for the next step's quorum while the optimizer steps.
Every ``digest_every`` steps the group reports a digest of its parameters and optimizer state
(ftjob.ft.integrity.duties). SIGTERM (ftjob.ft.step.termination) is acted on at a step boundary: the commit vote carries
it, so the whole group leaves after the same step; rank 0 tells the lighthouse at once (the survivors' next quorum forms
without it) and the next start_quorum() raises Terminated (exit 143). A SIGTERM while rank 0 waits for a quorum leaves
at once. Failures never block longer than ``collective_timeout_s``, and the lighthouse's abort signal (a member evicted,
timed out or disconnected) wakes a pending collective at once, on every rank (ftjob.ft.links.control_plane).

The state dict is checked when the Manager is built and whenever a snapshot is served: a state recovery cannot carry
fails this group with StateDictError (saying which entry and why), never a peer that asked to heal from it.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from ftjob import contract
from ftjob.contract.lighthouse_api import QuorumRequest, QuorumResponse
from ftjob.contract.tls import TlsConfig
from ftjob.ft.allreduce.grad_sync import GradientSync
from ftjob.ft.allreduce.process_group import CollectiveError, CrossGroupPG
from ftjob.ft.gc_freeze import freeze_loaded
from ftjob.ft.integrity.duties import DEFAULT_DIGEST_EVERY, Integrity
from ftjob.ft.integrity.guard import DEFAULT_NORM_RATIO, GuardConfig, sketch_from_environ
from ftjob.ft.links.control_plane import ControlPlane
from ftjob.ft.links.lighthouse_client import EvictedError, LighthouseError
from ftjob.ft.rank_metrics import TrainerMetrics, trainer_metrics
from ftjob.ft.recovery.codec import CodecError
from ftjob.ft.recovery.state_check import StateDictError, check_state_dict
from ftjob.ft.recovery.transport import RecoveryError, RecoveryServer, fetch_state
from ftjob.ft.step import termination
from ftjob.ft.step.manager_group import InGroup
from ftjob.ft.step.manager_types import GroupAnswer as _GroupAnswer
from ftjob.ft.step.manager_types import InitialSyncError, QuorumInfo, QuorumUnavailable, StateLostError, Terminated

log = logging.getLogger("ftjob.manager")
SIGTERM_POLL_S = 0.1  # how often rank 0, waiting for a quorum, looks whether SIGTERM came (a signal cannot wake it)
freeze_loaded()  # the Manager's own dependencies (aiohttp, pydantic, numpy, ...) too: ftjob.ft.gc_freeze


@dataclass
class ManagerConfig:
    """Where this rank sits and how patient it is. ``ftjob.ft.init`` fills it from the operator's environment."""

    group: str  # replica group id ("0", "1", ...)
    lighthouse_url: str
    token: str
    advertise_addr: str = "127.0.0.1"  # IP peers use to reach this rank's recovery server / store
    rank: int = 0  # rank inside the group (torch.distributed default group when world_size > 1)
    world_size: int = 1
    min_replicas: int = 1
    collective_timeout_s: float = 5.0  # bound on one cross-group collective
    quorum_timeout_s: float = 60.0
    lost_timeout_s: float = 600.0  # keep state and retry an unreachable lighthouse this long before giving up
    recovery_port: int = 0  # 0 = ephemeral
    store_port: int = 0  # 0 = ephemeral
    device: str = "cpu"  # "cuda" -> NCCL across groups (with pinned-memory recovery staging), else gloo
    heartbeat_interval_s: float = 0.1
    bucket_bytes: int = 25 * 1024 * 1024  # per collective, the first 1 MiB: as DDP (a larger first bucket costs CPU)
    recovery_parallelism: int = 4  # concurrent chunk requests while healing
    sync_at_start: bool = True  # at step 0, copy one reference group's state before training (else trust the seed)
    # integrity (ftjob.ft.integrity.duties; the same in every group: the guard adds a collective to every step)
    gradient_guard: bool = True
    guard_norm_ratio: float = DEFAULT_NORM_RATIO
    guard_sketch: bool = field(default_factory=sketch_from_environ)  # norms the groups check (FTJOB_GUARD_SKETCH)
    digest_every: int = DEFAULT_DIGEST_EVERY  # committed steps between state digests (needs replica_state; 0: never)
    # TLS to the lighthouse and between recovery servers: the FTJOB_TLS_* files of the env contract (None: plain HTTP)
    tls: TlsConfig | None = field(default_factory=TlsConfig.from_environ)
    # which generation of its group this process is (FTJOB_GENERATION, set by the operator and the local launcher),
    # sent with its registration: the lighthouse refuses a replaced generation's process (None: not set, not sent)
    generation: int | None = field(default_factory=contract.read_generation)


class Manager:
    """One rank's side of the step protocol above. ``state_dict``/``load_state_dict`` give and take everything a
    healing peer needs (model, optimizer, data position, ...); they are called on the training thread only."""

    def __init__(
        self,
        cfg: ManagerConfig,
        state_dict: Callable[[], dict[str, Any]],
        load_state_dict: Callable[[dict[str, Any]], None],
        metrics: TrainerMetrics | None = None,
        replica_state: Callable[[], list[torch.Tensor]] | None = None,
    ) -> None:
        """``metrics``: where the Prometheus metrics go (default: the process's, served on FTJOB_METRICS_PORT).
        ``replica_state``: the part of the state replicas hold bitwise equal, for the state digests
        (ftjob.ft.integrity.digest.replica_tensors(model, optimizer)); None: no digests."""
        check_state_dict(state_dict(), f"group {cfg.group} rank {cfg.rank}")  # before joining: fail alone
        self.cfg = cfg
        self._state_dict = state_dict
        self._load_state_dict = load_state_dict
        self.step = 0
        self.metrics: dict[str, float] = dict.fromkeys(("quorums", "pg_rebuilds", "heals", "heal_seconds", "commits",
                                                        "failed_commits", "aborted_collectives",
                                                        "recovery_chunk_retries"), 0)  # fmt: skip
        self.last_error: str | None = None  # why the last step failed (for logs)
        self.trainer_metrics = metrics if metrics is not None else trainer_metrics()
        if metrics is None:
            self.trainer_metrics.serve_from_env()
        self._fail_reason = "peer"
        self._t_commit: float | None = None  # end of the last commit (or of the first quorum): step_seconds
        self._t_quorum_start = self._t_quorum_end = self._t_reduce_start = self._t_reduce_end = 0.0
        self._group = InGroup(cfg.rank, cfg.world_size)
        self._pg = CrossGroupPG(cfg.rank, cfg.advertise_addr, cfg.store_port, cfg.device, cfg.collective_timeout_s)
        guard, tm = GuardConfig(cfg.gradient_guard, cfg.guard_norm_ratio, cfg.guard_sketch), self.trainer_metrics
        self._integrity = Integrity(cfg.group, self._group, tm, guard, cfg.digest_every, replica_state)
        self._grads = GradientSync(
            self._pg, cfg.bucket_bytes, cfg.world_size == 1, guard.enabled, int(cfg.group), guard.sketch
        )
        self._recovery = RecoveryServer(cfg.token, cfg.advertise_addr, cfg.recovery_port, tls=cfg.tls)
        # only rank 0 talks to the lighthouse; the group link reaches the other ranks
        self._control = ControlPlane(cfg, self._on_abort, self.trainer_metrics.lighthouse_reconnected)
        endpoints = self._group.all_gather_json(
            [self._recovery.address, self._pg.store_address, self._control.link_address]
        )
        self._addresses = [e[0] for e in endpoints]
        self._store_addresses = [e[1] for e in endpoints]
        self.incarnation = self._group.broadcast_json(uuid.uuid4().hex[:16])
        self._control.connect(endpoints[0][2], self.incarnation)
        self._fresh = cfg.sync_at_start  # not yet synced with the job (only matters while step == 0)
        self._torn = False  # a heal failed after writing into this rank's (or a group peer's) state
        self._quorum_id = -1  # last quorum id seen (reported so a restarted lighthouse keeps ids increasing)
        self._inflight: int | None = None  # quorum id of the step in progress
        self._info: QuorumInfo | None = None
        self._step_error: str | None = None
        self._commit_failures = 0
        self._last_heal_s: float | None = None
        self._prefetched: concurrent.futures.Future[QuorumResponse] | None = None  # next step's quorum request
        self._leaving = False  # the group voted to leave the job (SIGTERM): it left the lighthouse, exits next step
        # last: SIGTERM is this Manager's to act on from now until shutdown() (unless the script has its own handler)
        self.handles_sigterm = termination.WATCH.claim()
        self._claimed = True

    def register_params(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Lets the all-reduce of each gradient bucket start during the backward pass (hooks on ``params``, which
        must be the list later given to allreduce_gradients). A no-op for sharded groups (world_size > 1): FSDP2
        reduces inside the group only after the backward."""
        self._grads.register(params)

    def set_gradient_weight(self, weight: float) -> None:
        """This step's weight of this group's gradients in the average (uneven shares of a fixed global batch:
        ftjob.ft.wrappers.sharding); call after start_quorum(), before the backward pass."""
        self._grads.set_weight(weight)

    def set_loss_scaling(self, on: bool) -> None:
        """A loss scaler (GradScaler) skips non-finite steps itself: the gradient guard then judges norms only."""
        self._integrity.loss_scaling = on

    def hold_gradient_sync(self, held: bool) -> None:
        """While held, backward passes only accumulate gradients (no bucket starts): gradient accumulation."""
        self._grads.hold(held)

    # --- abort signal ------------------------------------------------------------------------------------------
    def _should_abort(self) -> bool:
        return self._inflight is not None and self._control.aborts(self._inflight)

    def _on_abort(self, _abort_below: int) -> None:  # lighthouse client thread (rank 0) or group link thread
        if self._should_abort():
            self._pg.interrupt()

    # --- step protocol -----------------------------------------------------------------------------------------
    def _quorum_request(self) -> QuorumRequest:
        return QuorumRequest(
            group=self.cfg.group,
            incarnation=self.incarnation,
            generation=self.cfg.generation,
            step=self.step,
            quorum_id=self._quorum_id,
            commit_failures=self._commit_failures,
            address=self._addresses[0],
            store_address=self._store_addresses[0],
            addresses=self._addresses,
            store_addresses=self._store_addresses,
            world_size=self.cfg.world_size,
            heal_seconds=self._last_heal_s,
            fresh=self._fresh and self.step == 0,
            **self._integrity.report_fields(),  # a refused step's verdict, a state digest: each sent once
        )

    def prefetch_quorum(self) -> None:
        """Sends the next step's quorum request now (right after a commit), so its round-trip overlaps the
        optimizer step instead of opening the next step; start_quorum() then collects the answer."""
        if self.cfg.rank == 0 and self._prefetched is None and not self._leaving:
            self._prefetched = self._control.client.quorum_async(self._quorum_request(), self.cfg.quorum_timeout_s)

    def _ask_lighthouse(self) -> _GroupAnswer:
        if self.cfg.rank != 0:
            return _GroupAnswer()
        pending, self._prefetched = self._prefetched, None
        client = self._control.client
        try:
            if pending is None:
                pending = client.quorum_async(self._quorum_request(), self.cfg.quorum_timeout_s)
            answer = self._await_quorum(pending, client.quorum_wait_bound(self.cfg.quorum_timeout_s))
            if answer is None:
                return _GroupAnswer(leaving=True)
            self._last_heal_s = None
            return _GroupAnswer(quorum=answer)
        except EvictedError as e:
            return _GroupAnswer(error=str(e), evicted=True)
        except (LighthouseError, TimeoutError) as e:
            self._control.check()  # this group lost a rank (it left the lighthouse): no broadcast to the dead rank
            return _GroupAnswer(error=str(e))

    def _await_quorum(
        self, pending: concurrent.futures.Future[QuorumResponse], bound_s: float
    ) -> QuorumResponse | None:
        """The answer to the quorum request in flight, or None when SIGTERM came while waiting for it (the request is
        given up: between steps this group can leave at once)."""
        deadline = time.monotonic() + bound_s
        while True:
            if termination.WATCH.requested():
                pending.cancel()  # the lighthouse forgets it; should it have formed meanwhile, the leave aborts it
                return None
            try:
                return pending.result(max(0.0, min(SIGTERM_POLL_S, deadline - time.monotonic())))
            except TimeoutError:
                if pending.done() or time.monotonic() >= deadline:  # the request's own timeout, or the bound's
                    pending.cancel()
                    raise

    def start_quorum(self) -> QuorumInfo:
        """Joins this step's quorum; heals first if behind. Raises EvictedError / QuorumUnavailable (exit),
        StateDictError (this group's state cannot be served to a healing peer), InitialSyncError, StateLostError,
        GroupLinkLost, and Terminated (SIGTERM: the group left the job at this step boundary)."""
        if self._leaving:
            self._exit_terminated()
        self._control.check()  # a rank of this group died: the whole group exits
        self._t_quorum_start = time.monotonic()
        if self._t_commit is None:
            self._t_commit = self._t_quorum_start  # the first step's time counts from its quorum request
        self._step_error = None
        self._t_reduce_start = 0.0
        self._integrity.at_step_boundary(self.step)  # the state committed at self.step: digest (and test faults)
        answer = _GroupAnswer.model_validate(self._group.broadcast_json(self._ask_lighthouse().model_dump(mode="json")))
        if answer.leaving:
            self._leave()
            self._exit_terminated()
        if answer.quorum is None:
            if answer.evicted:
                raise EvictedError(410, answer.error or "evicted")
            raise QuorumUnavailable(f"group {self.cfg.group}: {answer.error}")
        q = answer.quorum
        self._quorum_id = self._inflight = q.quorum_id
        self._control.progress()
        self.metrics["quorums"] += 1
        if self._torn and not q.heal:  # nobody ahead to copy a whole state from: never train or serve a torn one
            raise StateLostError(f"group {self.cfg.group}: a failed heal left a partial state and no peer is ahead")
        if q.serve_recovery:  # a healer copies from us: snapshot now, at the step boundary; served aside
            self._publish()
        try:
            rebuilt = self._pg.configure(
                q.quorum_id,
                q.store_addresses[self.cfg.rank],
                q.store_prefix,
                q.replica_rank,
                q.replica_world_size,
                self._should_abort,
            )
            self.metrics["pg_rebuilds"] += int(rebuilt)
        except CollectiveError as e:
            self._fail(str(e), "process_group")
        healed = self._heal(q) if q.heal else False
        if not q.heal or healed:
            self._fresh = False  # the reference of a step-0 sync, a synced copy, or simply past step 0
        # The lighthouse counts a healer as a contributor only when it heals to the step it trains (the step-0
        # sync); it has the state before its forward pass. A group behind is never a contributor.
        self._info = QuorumInfo(
            quorum_id=q.quorum_id,
            step=self.step,
            contributing=q.contributing,
            contributor_rank=q.contributor_rank if q.contributing else -1,
            num_contributors=q.num_contributors,
            participants=q.replica_world_size,
            healed=healed,
        )
        self._grads.arm(
            q.contributing and self._step_error is None and self._pg.quorum_id == self._inflight,
            self._integrity.corruption(self.step, q.contributing),
        )
        state = "contributing" if q.contributing else "healing" if q.heal else "spare"
        self.trainer_metrics.quorum_joined(q.quorum_id, q.replica_world_size, state)
        self._t_quorum_end = time.monotonic()
        return self._info

    def _publish(self) -> None:
        try:
            self._recovery.publish(self.step, self._state_dict())
        except CodecError as e:  # the state changed since it was checked: this group is broken, not its peer
            raise StateDictError(
                f"group {self.cfg.group} rank {self.cfg.rank}: state_dict() can no longer be sent to a healing "
                f"peer: {e}"
            ) from None

    def _heal(self, q: QuorumResponse) -> bool:
        source = q.recover_from
        assert source is not None
        address = source.addresses[self.cfg.rank]
        start = time.monotonic()
        error = None
        try:
            state, stats = fetch_state(
                address,
                q.max_step,
                self.cfg.token,
                template=self._state_dict(),
                device=self.cfg.device,
                parallel=self.cfg.recovery_parallelism,
                timeout_s=self.cfg.quorum_timeout_s,
                tls=self.cfg.tls,
            )
            self.metrics["recovery_chunk_retries"] += stats.retries
            self._load_state_dict(state)  # on the caller's (training) thread, at the step boundary
        except (RecoveryError, CodecError, KeyError, RuntimeError, ValueError) as e:
            error = f"healing from group {source.group} at {address} failed: {e}"
        if not self._group.all_true(error is None):  # every rank healed, or the group stays at its old step
            why = error or "another rank of this group failed to heal"
            if q.contributing:  # a step-0 sync: training on this group's own weights would split the job
                raise InitialSyncError(f"group {self.cfg.group}: copying the reference state at step 0: {why}")
            self._fail(why, "heal")
            self._torn = (
                True  # received in place (ftjob.ft.recovery.transport.fetch_state): heal again before anything else
            )
            return False
        self._torn, self.step = False, q.max_step
        self._control.set_step(self.step)
        self._last_heal_s = time.monotonic() - start
        self.metrics["heals"] += 1
        self.metrics["heal_seconds"] += self._last_heal_s
        self.trainer_metrics.healed(self._last_heal_s, stats.bytes)
        log.info(
            "group %s rank %d healed to step %d in %.3fs", self.cfg.group, self.cfg.rank, self.step, self._last_heal_s
        )
        return True

    def _fail(self, why: str, reason: str) -> None:
        if self._step_error is None:
            self._step_error = why
            self._fail_reason = reason  # a bounded label value (ftjob.ft.rank_metrics.FAILURE_REASONS)
            log.warning("group %s rank %d step %d fails: %s", self.cfg.group, self.cfg.rank, self.step, why)

    def allreduce_gradients(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Averages the gradients in place over the contributors (zeros from non-contributors)."""
        self._t_reduce_start = time.monotonic()
        params = [p for p in params if p.requires_grad]
        info = self._info
        if info is None:
            raise RuntimeError("allreduce_gradients() called before start_quorum() for this step")
        if self._step_error is not None and self._pg.quorum_id != self._inflight:
            return  # no process group for this quorum: nothing to take part in
        # A step that already failed (e.g. its heal) still takes part, sending zeros, so its peers are not left
        # waiting for a collective timeout; its own result is discarded by should_commit().
        self._control.progress(waiting=True)  # seen by stall detection
        try:
            error = self._grads.allreduce(
                params, info.num_contributors, info.contributing, self._step_error is not None, self._should_abort
            )
        finally:
            self._control.progress(waiting=False)
        if error is not None:
            self.metrics["aborted_collectives"] += 1
            self._fail(error, "collective")
        self._t_reduce_end = time.monotonic()

    def should_commit(self) -> bool:
        """Unanimous vote of the group's ranks; True -> the caller steps the optimizer, and ``step`` moves on."""
        t_vote = time.monotonic()
        ok = self._info is not None and self._step_error is None
        if ok and self._info is not None and self._info.participants < self.cfg.min_replicas:
            self._fail(
                f"only {self._info.participants} groups in the quorum, min_replicas is {self.cfg.min_replicas}",
                "min_replicas",
            )
            ok = False
        participants = self._info.participants if self._info else 0
        leaving = termination.WATCH.requested()  # this rank's; the vote says whether any rank of the group got it
        ok, refused, leave = self._integrity.vote(
            ok, self._grads.guard_table, participants, self._grads.roundoff, leaving
        )
        if refused is not None:
            self._fail(refused, "guard")  # every group judged the same numbers: no group commits this step
        self._integrity.after_vote(ok, self._info.quorum_id if self._info else self._quorum_id, self.step)
        if ok:
            self.step += 1
            self._commit_failures = 0
            self.metrics["commits"] += 1
            self._record_commit(t_vote)
        else:
            self._commit_failures += 1
            self.metrics["failed_commits"] += 1
            self.last_error = self._step_error or "another rank of this group could not commit"
            reason = self._fail_reason if self._step_error is not None else "peer"
            self.trainer_metrics.commit_failed(reason)
        self._control.set_step(self.step)
        self._info = None
        self._inflight = None
        self._grads.disarm()
        if leave:
            self._leave()
        return ok

    def _leave(self) -> None:
        """The group leaves the job at this step boundary (a rank of it got SIGTERM): rank 0 tells the lighthouse now,
        so the survivors' next quorum forms without this group, and nothing is asked any more."""
        if self._leaving:
            return
        self._leaving = True
        if self._prefetched is not None:
            self._prefetched.cancel()
            self._prefetched = None
        log.warning("group %s rank %d: SIGTERM: leaving the job at step %d", self.cfg.group, self.cfg.rank, self.step)
        self._control.leave(self.step)

    def _exit_terminated(self) -> None:
        """Raises Terminated on every rank together: a rank > 0 waits until rank 0 has told the lighthouse (its exit
        would otherwise drop the group link first, which rank 0 takes for a dead rank)."""
        self._group.all_true(True)
        raise Terminated(f"group {self.cfg.group} rank {self.cfg.rank}: SIGTERM: left the job at step {self.step}")

    def _record_commit(self, t_vote: float) -> None:
        """The phases the Manager can time itself, at the same boundaries as ftjob.gpt's CommitRecord.phases:
        quorum = start_quorum(), compute = from there to allreduce_gradients(), allreduce = that call, commit = the
        vote. A loop that never calls allreduce_gradients() gets no compute/allreduce phase."""
        now = time.monotonic()
        phases = {"quorum": self._t_quorum_end - self._t_quorum_start, "commit": now - t_vote}
        if self._t_reduce_start:
            phases["compute"] = self._t_reduce_start - self._t_quorum_end
            phases["allreduce"] = self._t_reduce_end - self._t_reduce_start
        step_s = now - self._t_commit if self._t_commit is not None else None
        self._t_commit = now
        self.trainer_metrics.committed(self.step, step_s, phases)

    def check_state(self) -> None:
        """Checks the current state dict again (after it changed shape); StateDictError names what is wrong."""
        check_state_dict(self._state_dict(), f"group {self.cfg.group} rank {self.cfg.rank}")

    def report_finished(self, param_digest: str) -> None:
        """Tells the lighthouse this group trained its last step, with a digest of its parameters (unless the group
        left the job after that step: SIGTERM)."""
        if not self._leaving:
            self._control.report_finished(self.step, param_digest)

    def shutdown(self) -> None:
        """Releases everything the Manager holds: the SIGTERM claim, the prefetched quorum request, the
        lighthouse and group links, the recovery server and the process group."""
        if self._claimed:
            termination.WATCH.release()
            self._claimed = False
        if self._prefetched is not None:
            self._prefetched.cancel()  # the lighthouse then forgets the request (its connection closes)
        self._control.close()
        self._recovery.close()
        self._pg.close()
