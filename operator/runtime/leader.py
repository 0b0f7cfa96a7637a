"""Leader election on a coordination.k8s.io/v1 Lease, so several operator replicas can run and exactly one acts.

Acquire: create the Lease, or take it over when its holder has not renewed it for leaseDurationSeconds. Expiry is
judged by *our own* clock from when we last saw the record change (as client-go does), never by comparing our
clock with the holder's renewTime, so clock skew between replicas cannot cause two leaders.
Every write is a replace carrying the resourceVersion we read: if two candidates race, one gets 409 and loses.
A leader that cannot renew within renew_deadline stops acting (the caller exits); on a clean shutdown it releases
the Lease so the standby takes over at once.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from dataclasses import dataclass

from kubernetes import client
from kubernetes.client.rest import ApiException

log = logging.getLogger("ftjob.operator.runtime.leader")


@dataclass(frozen=True)
class LeaseConfig:
    """Which Lease the replicas compete for, who this one is, and the lease's timing (client-go's defaults)."""

    name: str
    namespace: str
    identity: str
    lease_duration_s: float = 15.0
    renew_deadline_s: float = 10.0
    retry_period_s: float = 2.0


def _now_micro() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class LeaderElector:
    """Leader election on one coordination.k8s.io/v1 Lease: acquires, renews and releases it for this replica."""

    def __init__(self, api: client.ApiClient, cfg: LeaseConfig) -> None:
        self.coord = client.CoordinationV1Api(api)
        self.cfg = cfg
        self.is_leader = False
        self._observed: tuple[str | None, str | None] | None = None  # (holder, renewTime) last seen
        self._observed_at = 0.0
        self._timeout = max(1.0, cfg.retry_period_s)  # one call never outlives a renew period

    # --- one attempt (sync; run in a thread) ------------------------------------------------------------------------
    def try_acquire_or_renew(self) -> bool:
        """One attempt (blocking; run it in a thread): creates the Lease, renews it, or takes it over once its
        holder stopped renewing for a whole lease duration. Returns whether this replica holds it now."""
        cfg = self.cfg
        try:
            lease = self.coord.read_namespaced_lease(cfg.name, cfg.namespace, _request_timeout=self._timeout)
        except ApiException as e:
            if e.status != 404:
                raise
            body = client.V1Lease(
                metadata=client.V1ObjectMeta(name=cfg.name, namespace=cfg.namespace),
                spec=self._spec(acquire=True, transitions=0),
            )
            try:
                self.coord.create_namespaced_lease(cfg.namespace, body, _request_timeout=self._timeout)
                return True
            except ApiException as e2:
                if e2.status == 409:
                    return False
                raise
        spec = lease.spec or client.V1LeaseSpec()
        holder = spec.holder_identity
        renew = spec.renew_time.isoformat() if spec.renew_time else None
        now = time.monotonic()
        if self._observed != (holder, renew):
            self._observed, self._observed_at = (holder, renew), now
        duration = spec.lease_duration_seconds or cfg.lease_duration_s
        expired = now - self._observed_at >= duration
        if holder and holder != cfg.identity and not expired:
            return False
        transitions = (spec.lease_transitions or 0) + (0 if holder == cfg.identity else 1)
        lease.spec = self._spec(acquire=holder != cfg.identity, transitions=transitions, previous=spec)
        try:
            self.coord.replace_namespaced_lease(cfg.name, cfg.namespace, lease, _request_timeout=self._timeout)
        except ApiException as e:
            if e.status == 409:  # someone else wrote first: they win this round
                return False
            raise
        return True

    def _spec(self, acquire: bool, transitions: int, previous: client.V1LeaseSpec | None = None) -> client.V1LeaseSpec:
        now = _now_micro()
        return client.V1LeaseSpec(
            holder_identity=self.cfg.identity,
            lease_duration_seconds=max(1, int(self.cfg.lease_duration_s)),
            acquire_time=now if acquire or previous is None else previous.acquire_time,
            renew_time=now,
            lease_transitions=transitions,
        )

    def release(self) -> None:
        """Give the Lease up (holder cleared, 1 s duration) so a standby need not wait for expiry."""
        try:
            lease = self.coord.read_namespaced_lease(self.cfg.name, self.cfg.namespace)
            if lease.spec and lease.spec.holder_identity == self.cfg.identity:
                lease.spec.holder_identity = None
                lease.spec.lease_duration_seconds = 1
                self.coord.replace_namespaced_lease(self.cfg.name, self.cfg.namespace, lease)
        except Exception as e:
            log.warning("could not release the lease: %s", e)
        self.is_leader = False

    # --- loops ------------------------------------------------------------------------------------------------------
    async def acquire(self) -> None:
        """Return once we lead. Logs while standing by."""
        announced = False
        while True:
            try:
                if await asyncio.to_thread(self.try_acquire_or_renew):
                    self.is_leader = True
                    log.info("acquired leader lease %s/%s as %s", self.cfg.namespace, self.cfg.name, self.cfg.identity)
                    return
            except Exception as e:
                log.warning("leader election attempt failed: %s", e)
            if not announced:
                holder = self._observed[0] if self._observed else None
                log.info("standing by: lease %s/%s is held by %s", self.cfg.namespace, self.cfg.name, holder)
                announced = True
            await asyncio.sleep(self.cfg.retry_period_s)  # the retry period of the election protocol

    async def keep(self) -> None:
        """Renew until a renewal fails for longer than renew_deadline; then return (leadership lost)."""
        last_ok = time.monotonic()
        while True:
            await asyncio.sleep(self.cfg.retry_period_s)  # renew cadence, part of the protocol
            try:
                if await asyncio.to_thread(self.try_acquire_or_renew):
                    last_ok = time.monotonic()
                    continue
                log.error("lost the leader lease to %s", self._observed[0] if self._observed else None)
                self.is_leader = False
                return
            except Exception as e:
                log.warning("lease renewal failed: %s", e)
            if time.monotonic() - last_ok > self.cfg.renew_deadline_s:
                log.error("could not renew the leader lease for %.0fs; stepping down", self.cfg.renew_deadline_s)
                self.is_leader = False
                return
