"""An old incarnation's eviction never restarts, budgets or moves a newer generation (no cluster).

The case found in chaos runs: the lighthouse pod and group 1's pod are force-deleted in one call; the operator
replaces both (group 1 as generation 1), but the old group-1 process lives on for a moment, registers with the
replacement lighthouse and is evicted there (stalled: it is being killed). That drop names generation 0, so the
operator charges it to nobody: no restart, no budget, no avoided node for generation 1. A drop of the current
generation restarts the group as before, and one that names no generation (an older trainer) is judged by its time as
before. The operator also tells the lighthouse each group's running generation, in the replacement lighthouse pod
and again whenever one changes, and a group's absence from a new lighthouse (even at its predecessor's IP) is no
silence."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from ftjob import contract
from ftjob.contract.lighthouse_api import DroppedEvent, MemberStatus, StatusResponse
from ftjob.operator.lighthouse.link import declared_generations
from ftjob.operator.lighthouse.view import SILENCE_MIN_S, LighthouseView, SilenceWatch
from ftjob.operator.planning.actions import Actions, Result
from ftjob.operator.planning.integrity_evictions import integrity_drops
from ftjob.operator.planning.plan import PHASE_RUNNING, Observed, plan
from ftjob.operator.reconcile.job_reconciler import JobWorker
from ftjob.operator.resources import manifests as builders
from ftjob.operator.state import names
from ftjob.operator.state.job_spec import JobSpec
from ftjob.operator.state.job_state import JobState, PodView
from test_job_lighthouse import BASE, FakeLighthouse, first_reconcile, job_worker

from tests.support.podfactory import JOB, healthy_job, lighthouse, spec, worker

NOW = 1_000_000.0
NODES = {"node-1": True, "node-2": True}
LOSS = NOW + 10  # the lighthouse and group 1's pods are force-deleted
STALLED = "evicted: stalled: no heartbeat for 1.21s (limit 1.00s) while the other groups train on without it"
GUARD = "evicted: gradient_guard: 3 refused steps within 600s (nonfinite gradient)"
DIVERGENT = "evicted: divergent: digest at step 60 differs from the majority of 3 groups"
REASONS = [(STALLED, "Stalled"), (GUARD, "GradientGuard"), (DIVERGENT, "ReplicaDivergence")]


def observe(s: JobSpec, state: JobState, pods: list[PodView], now: float, **kw: Any) -> Result:
    return plan(JOB, s, state, Observed(pods, NODES, set(), now, **kw))


def after_the_loss() -> tuple[JobSpec, JobState, list[PodView]]:
    """The state once the operator replaced the lighthouse and group 1 (generation 1, its pods on node-2)."""
    s = spec()
    state = observe(s, JobState(), [], NOW).state
    state = observe(s, state, healthy_job(s), NOW).state
    survivors = [p for p in healthy_job(s) if p.group not in (None, 1)]
    lost = observe(s, state, survivors, LOSS)
    assert lost.state.groups[1].generation == 1 and lost.state.lighthouse_generation == 1
    assert lost.state.restarts_by_reason == {"LighthouseFailed": 1, "PodDeleted": 1}
    pods = [*survivors, lighthouse(1), *(worker(1, r, generation=1, node="node-2") for r in range(2))]
    return s, lost.state, pods


def view_of(*events: DroppedEvent, members: tuple[MemberStatus, ...] = (), clock: float = 500.0) -> LighthouseView:
    return LighthouseView.from_status(StatusResponse(
        quorum_id=41, max_step=300, abort_below=0, min_replicas=2, quorum_groups=["0", "2"], members=list(members),
        starting=[], blocked_reason="", history=list(events), clock=clock))  # fmt: skip


def member(group: int, generation: int | None) -> MemberStatus:
    return MemberStatus(group=str(group), incarnation=f"inc-{group}-{generation}", step=300, address="10.0.0.5:1",
                        last_heartbeat_age_s=0.1, in_quorum=True, asking=False, healing=False, contributing=True,
                        finished=False, generation=generation)  # fmt: skip


def with_drop(s: JobSpec, state: JobState, pods: list[PodView], reason: str, generation: int | None) -> Result:
    """The replacement lighthouse's answer, read 2 s after it evicted one incarnation of group 1 (5 s after the
    loss: after generation 1 began)."""
    view = view_of(DroppedEvent(time=498.0, group="1", reason=reason, generation=generation))
    return observe(s, state, pods, LOSS + 7, integrity_drops=integrity_drops(view.integrity_drops, LOSS + 7))


@pytest.mark.parametrize(("reason", "_"), REASONS)
def test_an_old_generations_eviction_never_restarts_budgets_or_moves_the_new_one(reason: str, _: str):
    s, state, pods = after_the_loss()
    r = with_drop(s, state, pods, reason, generation=0)
    g, a = r.state.groups[1], r.actions
    assert g.generation == 1 and g.restarts == 1, "no third generation for one loss"
    assert r.state.restarts_by_reason == {"LighthouseFailed": 1, "PodDeleted": 1}
    assert r.state.total_restarts == state.total_restarts and g.restart_times == state.groups[1].restart_times
    assert (g.avoid_node, g.avoid_required) == (None, False), "generation 1 is not kept off its node"
    assert not (a.restarts or a.evict or a.delete_pods or a.create_pods or a.failed_nodes)
    assert r.group_phases[1] == PHASE_RUNNING


@pytest.mark.parametrize(("reason", "failure"), REASONS)
def test_the_current_generations_eviction_restarts_it_as_before(reason: str, failure: str):
    s, state, pods = after_the_loss()
    r = with_drop(s, state, pods, reason, generation=1)
    g = r.state.groups[1]
    assert g.generation == 2 and r.state.restarts_by_reason[failure] == 1 and r.actions.restarts == [failure]
    assert r.state.total_restarts == state.total_restarts + 1, "it spends restart budget"
    assert g.avoid_node == "node-2"


def test_a_drop_that_names_no_generation_is_judged_by_its_time_as_before():
    s, state, pods = after_the_loss()
    assert with_drop(s, state, pods, STALLED, generation=None).state.groups[1].generation == 2
    early = view_of(DroppedEvent(time=490.0, group="1", reason=STALLED), clock=500.0)  # 10 s before: at the loss
    r = observe(s, state, pods, LOSS + 7, integrity_drops=integrity_drops(early.integrity_drops, LOSS + 7))
    assert r.state.groups[1].generation == 1


def silence_after(listed_generation: int) -> dict[int, str]:
    """The replacement lighthouse lists group 1 as a member of ``listed_generation`` (the old process re-registered
    there, or the new one joined), then no longer lists it for longer than the silence limit."""
    s, state, _ = after_the_loss()
    watch, limit = SilenceWatch(), max(2 * s.lighthouse.heartbeat_timeout_s, SILENCE_MIN_S)
    everyone = view_of(members=(member(0, 0), member(1, listed_generation), member(2, 0)))
    assert watch.silent(everyone, LOSS + 1, state, s.lighthouse.heartbeat_timeout_s, LOSS + 1) == {}
    assert watch.silent(everyone, LOSS + 3, state, s.lighthouse.heartbeat_timeout_s, LOSS + 3) == {}
    gone = view_of(members=(member(0, 0), member(2, 0)))
    watch.silent(gone, LOSS + 5, state, s.lighthouse.heartbeat_timeout_s, LOSS + 5)
    return watch.silent(gone, LOSS + 6 + limit, state, s.lighthouse.heartbeat_timeout_s, LOSS + 6 + limit)


def test_an_old_process_leaving_the_lighthouse_is_no_silence_of_the_new_generation():
    s, state, pods = after_the_loss()
    silent = silence_after(listed_generation=0)
    assert silent == {}
    r = observe(s, state, pods, LOSS + 40, silent_groups=silent)
    assert r.state.groups[1].generation == 1 and not r.actions.restarts


def test_the_current_generation_leaving_the_lighthouse_is_heartbeat_lost_as_before():
    s, state, pods = after_the_loss()
    silent = silence_after(listed_generation=1)
    assert list(silent) == [1]
    r = observe(s, state, pods, LOSS + 40, silent_groups=silent)
    assert r.state.groups[1].generation == 2 and r.actions.restarts == ["HeartbeatLost"]


# --- what the operator tells the lighthouse ------------------------------------------------------------------------
def test_each_groups_running_generation_is_declared_and_again_whenever_one_changes():
    s, r = first_reconcile()
    lh = FakeLighthouse()
    w = job_worker(lh)
    w.pending_starting.update(r.actions.starting)
    assert asyncio.run(w._tell_lighthouse(BASE, s, r)) is False
    assert lh.generations == [{0: 0, 1: 0, 2: 0}]
    state = r.state.copy()
    state.groups[1].generation = 1  # group 1 replaced
    state.groups[2].migrating_from, state.groups[2].generation = 0, 1  # group 2 migrating: generation 0 trains on
    w.lh_retry_at = 0.0
    assert asyncio.run(w._tell_lighthouse(BASE, s, Result(state, r.actions, r.group_phases))) is False
    assert lh.generations[-1] == {0: 0, 1: 1, 2: 0} == declared_generations(state)
    assert [c[0] for c in lh.calls] == ["desired", "starting", "desired"], "starting groups are not re-announced"


def test_a_replacement_lighthouse_at_its_predecessors_ip_is_told_everything_again():
    s, r = first_reconcile()
    lh = FakeLighthouse()
    w = job_worker(lh)
    assert asyncio.run(w._tell_lighthouse(BASE, s, r)) is False
    state = r.state.copy()
    state.lighthouse_generation += 1  # same address (BASE), another lighthouse
    w.lh_retry_at = 0.0
    assert asyncio.run(w._tell_lighthouse(BASE, s, Result(state, r.actions, r.group_phases))) is False
    told = [("desired", s.replicas, s.total_groups), ("starting", 0, 1, 2)]
    assert lh.calls == told * 2, "the new one learns the count, the generations and who is on the way"
    assert lh.generations == [{0: 0, 1: 0, 2: 0}] * 2


def test_a_replacement_lighthouse_pod_knows_each_groups_generation_from_its_start():
    s, state, _ = after_the_loss()
    pod = builders.lighthouse_pod(JOB, "ns", s, 1, 41, 300, None, declared_generations(state))
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env[contract.ENV_GROUP_GENERATIONS] == "0:0,1:1,2:0"
    assert contract.parse_generations(env[contract.ENV_GROUP_GENERATIONS]) == {"0": 0, "1": 1, "2": 0}
    plain = builders.lighthouse_pod(JOB, "ns", s, 0)
    assert contract.ENV_GROUP_GENERATIONS not in {e["name"] for e in plain["spec"]["containers"][0]["env"]}


class StatusLighthouse(FakeLighthouse):
    """Answers each status poll with the next view queued."""

    def __init__(self) -> None:
        super().__init__()
        self.views: list[LighthouseView] = []

    async def status(self, base: Any, token: str) -> LighthouseView | None:
        return self.views.pop(0)


def test_groups_not_back_yet_at_a_replacement_lighthouse_at_the_same_ip_are_not_silent():
    """A new lighthouse pod may get its predecessor's IP: its generation, not its address, says it is new."""
    s, state, _ = after_the_loss()
    state.groups[1].generation = 0  # (here only the lighthouse is replaced)
    lh = StatusLighthouse()
    w = job_worker(lh)
    w.state = state
    ip = "10.0.0.9"

    def poll(generation: int, listed: tuple[int, ...], at: float) -> dict[int, str]:
        w.state.lighthouse_generation = generation
        lh.views.append(view_of(members=tuple(member(g, 0) for g in listed)))
        asyncio.run(w._poll_lighthouse([lighthouse(generation, ip=ip)], at, force=True))
        return w._silent_groups(s, at)

    limit = max(2 * s.lighthouse.heartbeat_timeout_s, SILENCE_MIN_S)
    assert names.lighthouse_pod(JOB, 0) != names.lighthouse_pod(JOB, 1)
    t = LOSS + 100
    assert poll(1, (0, 1, 2), t) == {} and poll(1, (0, 1, 2), t + 2) == {}  # every group joined lighthouse 1
    assert poll(2, (0, 2), t + 4) == {}  # lighthouse 2, same IP: group 1 is still reconnecting
    assert poll(2, (0, 2), t + 6 + limit) == {}, "absent from a lighthouse it never joined: no silence"
    assert poll(2, (0, 1, 2), t + 8 + limit) == {}  # back
    assert poll(2, (0, 2), t + 10 + limit) == {}
    assert list(poll(2, (0, 2), t + 12 + 2 * limit)) == [1], "once it joined the new one, its silence counts"


class CreatingKube:
    """Records what the worker creates."""

    def __init__(self) -> None:
        self.created: list[dict[str, Any]] = []

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.created.append(obj)
        return obj

    async def delete_pod(self, namespace: str, name: str, force: bool) -> None:
        return None


def test_the_operator_creates_the_replacement_lighthouse_with_the_generations_it_just_decided():
    s, state, _ = after_the_loss()
    kube = CreatingKube()
    body = {"apiVersion": f"{contract.API_GROUP}/{contract.API_VERSION}", "kind": contract.KIND,
            "metadata": {"name": JOB, "namespace": "ns", "uid": "u1"}, "spec": {}}  # fmt: skip
    w = JobWorker("ns", JOB, body, kube, FakeLighthouse(), {}, None, lambda *_: None, node_policy=object())  # type: ignore[arg-type]
    actions = Actions(create_lighthouse=state.lighthouse_generation)
    asyncio.run(w._apply_pods(s, Result(state, actions, {})))
    [pod] = kube.created
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env[contract.ENV_GROUP_GENERATIONS] == "0:0,1:1,2:0"
