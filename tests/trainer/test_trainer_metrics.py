"""The trainer's Prometheus metrics (ftjob.ft.rank_metrics): names follow Prometheus conventions in the parsed
exposition, the values follow the events, every rank serves them over HTTP, the Manager feeds them, and the operator and
the chart give pods the port and a PodMonitor."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import pytest
from ftjob import contract
from ftjob.ft.rank_metrics import FAILURE_REASONS, TrainerMetrics
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

TIMED = {"ftjob_trainer_step_seconds", "ftjob_trainer_phase_seconds", "ftjob_trainer_heal_seconds"}


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, sorted labels) -> value of every sample in an exposition."""
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            assert isinstance(s, Sample)
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def drive(m: TrainerMetrics) -> None:
    """Two committed steps, a failed one, a heal as a healing group, then contributing, tokens, a reconnect."""
    m.quorum_joined(quorum_id=3, size=2, state="healing")
    m.healed(seconds=1.5, nbytes=4096)
    m.commit_failed("collective")
    m.quorum_joined(quorum_id=4, size=3, state="contributing")
    m.committed(11, step_seconds=0.2, phases={"quorum": 0.01, "compute": 0.15, "allreduce": 0.03, "commit": 0.01})
    m.committed(12, step_seconds=0.3, phases={"quorum": 0.02})
    m.add_tokens(100)
    m.add_tokens(50)
    m.observe_phase("optimizer", 0.004)
    m.lighthouse_reconnected()


def test_exposition_follows_prometheus_conventions_and_the_values_follow_the_events():
    m = TrainerMetrics()
    drive(m)
    text = m.render().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name, family in families.items():
        assert name.startswith("ftjob_trainer_"), name
        if name.endswith("_created"):  # prometheus_client's creation timestamps: gauges in the classic format
            continue
        names = {s.name for s in family.samples}
        if family.type == "counter":
            assert all(n.endswith(("_total", "_created")) for n in names), names  # _total in the exposition
            assert not name.endswith("_total"), "the parser strips _total off a counter family's name"
        if "seconds" in name or name in TIMED:
            assert family.type == "histogram" and name.endswith("_seconds"), (name, family.type)
        if "bytes" in name:
            assert family.type == "counter" and f"{name}_total" in names, name
    assert set(families) >= {"ftjob_trainer_commits", "ftjob_trainer_heal_bytes"} | TIMED
    assert families["ftjob_trainer_committed_step"].type == "gauge"
    assert families["ftjob_trainer_tokens_per_second"].type == "gauge"

    v = samples(text)
    assert v[("ftjob_trainer_committed_step", ())] == 12
    assert v[("ftjob_trainer_commits_total", ())] == 2
    assert v[("ftjob_trainer_commit_failures_total", (("reason", "collective"),))] == 1
    for reason in set(FAILURE_REASONS) - {"collective"}:
        assert v[("ftjob_trainer_commit_failures_total", (("reason", reason),))] == 0  # present before it happens
    assert v[("ftjob_trainer_step_seconds_count", ())] == 2
    assert v[("ftjob_trainer_step_seconds_sum", ())] == pytest.approx(0.5)
    assert v[("ftjob_trainer_phase_seconds_count", (("phase", "quorum"),))] == 2
    assert v[("ftjob_trainer_phase_seconds_sum", (("phase", "compute"),))] == pytest.approx(0.15)
    assert v[("ftjob_trainer_phase_seconds_count", (("phase", "optimizer"),))] == 1  # a loop's own phase
    assert v[("ftjob_trainer_tokens_total", ())] == 150
    assert v[("ftjob_trainer_heals_total", ())] == 1
    assert v[("ftjob_trainer_heal_seconds_sum", ())] == pytest.approx(1.5)
    assert v[("ftjob_trainer_heal_bytes_total", ())] == 4096
    assert v[("ftjob_trainer_quorum_size", ())] == 3 and v[("ftjob_trainer_quorum_id", ())] == 4
    assert {s: v[("ftjob_trainer_state", (("state", s),))] for s in ("contributing", "spare", "healing")} == {
        "contributing": 1,
        "spare": 0,
        "healing": 0,
    }
    assert v[("ftjob_trainer_lighthouse_reconnects_total", ())] == 1
    with pytest.raises(ValueError):
        m.set_state("resting")


def test_tokens_per_second_is_a_rate_over_a_window(monkeypatch):
    clock = iter([100.0, 100.5, 101.0, 101.2])
    monkeypatch.setattr("ftjob.ft.rank_metrics.time.monotonic", lambda: next(clock))
    m = TrainerMetrics()
    m.add_tokens(1000)  # starts the window: trained before it
    m.add_tokens(300)  # 0.5 s: too short a window to say
    rate = ("ftjob_trainer_tokens_per_second", ())
    assert samples(m.render().decode())[rate] == 0
    m.add_tokens(300)  # 1.0 s: 600 tokens
    assert samples(m.render().decode())[rate] == pytest.approx(600.0)
    m.add_tokens(10)
    assert samples(m.render().decode())[rate] == pytest.approx(600.0)


def test_the_process_metrics_can_be_switched_off_for_measuring_their_cost(monkeypatch):
    from ftjob.ft import rank_metrics as metrics

    monkeypatch.setattr(metrics, "_default", None)
    monkeypatch.setenv(contract.ENV_METRICS_DISABLED, "1")
    off = metrics.trainer_metrics()
    assert isinstance(off, metrics.DisabledTrainerMetrics) and metrics.trainer_metrics() is off
    drive(off)  # a loop's own calls need no guard
    assert off.serve_from_env({contract.ENV_METRICS_PORT: "29540"}) is None
    assert samples(off.render().decode())[("ftjob_trainer_commits_total", ())] == 0


def test_every_rank_serves_its_metrics_over_http_when_the_env_names_a_port():
    from tests.support.ports import free_port

    m = TrainerMetrics()
    assert m.serve_from_env({}) is None and m.serve_from_env({contract.ENV_METRICS_PORT: "0"}) is None
    port = free_port()
    try:
        assert m.serve_from_env({contract.ENV_METRICS_PORT: str(port)}) == port
        assert m.serve(port) == port  # idempotent
        m.committed(7)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        assert samples(text)[("ftjob_trainer_committed_step", ())] == 7
        other = TrainerMetrics()
        assert other.serve_from_env({contract.ENV_METRICS_PORT: str(port)}) is None  # in use: logged, not fatal
    finally:
        m.close()


def test_manager_feeds_the_metrics(tmp_path: Path):
    """One group of one rank, in this process, against a real lighthouse: three committed steps, then the lighthouse
    is lost and replaced."""
    import torch
    from ftjob.ft.step.manager import Manager, ManagerConfig

    from tests.support.local_job import TOKEN, Lighthouse
    from tests.support.polling import wait_for

    lh = Lighthouse(tmp_path).start()
    mgr = None
    try:
        model = torch.nn.Linear(4, 4)
        m = TrainerMetrics()
        cfg = ManagerConfig(group="0", lighthouse_url=lh.url, token=TOKEN, quorum_timeout_s=30)
        mgr = Manager(cfg, model.state_dict, model.load_state_dict, metrics=m)
        assert mgr.trainer_metrics is m
        while mgr.step < 3:
            mgr.start_quorum()
            model(torch.randn(2, 4)).sum().backward()
            mgr.allreduce_gradients(model.parameters())
            assert mgr.should_commit()
        v = samples(m.render().decode())
        assert v[("ftjob_trainer_committed_step", ())] == 3 and v[("ftjob_trainer_commits_total", ())] == 3
        assert v[("ftjob_trainer_step_seconds_count", ())] == 3
        for phase in ("quorum", "compute", "allreduce", "commit"):
            assert v[("ftjob_trainer_phase_seconds_count", (("phase", phase),))] == 3, phase
        assert v[("ftjob_trainer_state", (("state", "contributing"),))] == 1
        assert v[("ftjob_trainer_quorum_size", ())] == 1 and v[("ftjob_trainer_quorum_id", ())] >= 1
        assert sum(val for (name, _), val in v.items() if name == "ftjob_trainer_commit_failures_total") == 0
        lh.kill()  # a lost lighthouse, replaced on the same address: the watch re-opens once
        lh.start()
        reconnects = ("ftjob_trainer_lighthouse_reconnects_total", ())
        wait_for(lambda: samples(m.render().decode())[reconnects] >= 1, 60, "the watch to reconnect")
        assert samples(m.render().decode())[("ftjob_trainer_lighthouse_reconnects_total", ())] == 1
    finally:
        if mgr is not None:
            mgr.shutdown()
        lh.kill()


def test_operator_gives_worker_containers_the_metrics_port_and_env():
    from ftjob.operator.resources import manifests as builders
    from ftjob.operator.state.job_spec import JobSpec
    from ftjob.operator.state.job_state import GroupState

    def pod(containers: list[dict]) -> dict:
        s = JobSpec.from_dict({"replicas": 2, "podsPerReplica": 1, "template": {"spec": {"containers": containers}}})
        return builders.worker_pod("demo", "ns", s, GroupState(index=0), rank=0)

    p = pod([{"name": "trainer", "image": "img", "ports": [{"name": "dbg", "containerPort": 5678}]}, {"name": "side"}])
    trainer, side = p["spec"]["containers"]
    assert trainer["ports"] == [
        {"name": "dbg", "containerPort": 5678},
        {"name": "metrics", "containerPort": contract.TRAINER_METRICS_PORT},
    ]
    assert "ports" not in side  # port names are unique per pod
    for c in (trainer, side):
        env = {e["name"]: e for e in c["env"]}
        assert env[contract.ENV_METRICS_PORT]["value"] == str(contract.TRAINER_METRICS_PORT)
    own = [{"name": "trainer", "image": "img", "ports": [{"name": "metrics", "containerPort": 29540}]}]
    assert pod(own)["spec"]["containers"][0]["ports"] == own[0]["ports"], "not declared twice"


def test_chart_podmonitor_selects_job_pods_in_every_namespace():
    from tests.support.helm import render

    assert "PodMonitor" not in {o["kind"] for o in render("pm", "ops")}
    (pm,) = [o for o in render("pm", "ops", {"podMonitor.enabled": "true"}) if o["kind"] == "PodMonitor"]
    spec = pm["spec"]
    assert pm["apiVersion"] == "monitoring.coreos.com/v1" and spec["namespaceSelector"] == {"any": True}
    (expr,) = spec["selector"]["matchExpressions"]
    assert expr["key"] == contract.LABEL_ROLE and expr["operator"] == "In"
    assert set(expr["values"]) == {contract.ROLE_WORKER, contract.ROLE_LIGHTHOUSE}
    assert spec["podTargetLabels"] == [contract.LABEL_JOB, contract.LABEL_GROUP, contract.LABEL_RANK]
    assert [(e.get("port"), e["path"], e.get("scheme", "http")) for e in spec["podMetricsEndpoints"]] == [
        (None, "/metrics", "http"),  # every rank's port of a worker pod, chosen by the relabelings below
        ("http", "/metrics", "http"),  # a lighthouse with spec.tls.enabled=false
        ("https", "/metrics", "https"),  # a TLS lighthouse (the default): its port is named https
    ]
    keep, *labels = spec["podMetricsEndpoints"][0]["relabelings"]
    assert keep["action"] == "keep" and keep["sourceLabels"] == ["__meta_kubernetes_pod_container_port_name"]
    # Prometheus anchors the regex: each local rank's port is kept (ranksPerPod), nothing else of the pod is
    kept = re.compile(f"^(?:{keep['regex']})$")
    for k in range(contract.MAX_RANKS_PER_POD):
        assert kept.match("metrics" if k == 0 else f"metrics-{k}")
    assert not any(kept.match(name) for name in ("http", "https", "metrics-", "metricsx", "dbg"))
    local_rank = {}
    for name in ("metrics", "metrics-3"):  # the local_rank label, as Prometheus's replace action computes it
        for r in labels:
            if m := re.fullmatch(r["regex"], name):
                local_rank[name] = m.expand(r["replacement"].replace("$1", r"\1"))
    assert local_rank == {"metrics": "0", "metrics-3": "3"}
