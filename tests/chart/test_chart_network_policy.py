"""The chart's NetworkPolicies guard what TLS does not cover: worker pods (gloo/NCCL collectives, the cross-group
TCPStore, the in-group rendezvous, recovery, metrics) accept connections only from the jobs' worker pods of their
namespace; networkPolicy.metricsFrom lets a scraper reach the /metrics ports and nothing else."""

from __future__ import annotations

from ftjob import contract

from tests.support.helm import render

SCRAPER = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}


def policies(values: dict[str, str]) -> dict[str, dict]:
    objs = render("np", "ops", {"networkPolicy.enabled": "true", **values})
    return {o["metadata"]["name"].removeprefix("np-ftjob-operator-"): o for o in objs if o["kind"] == "NetworkPolicy"}


def test_worker_pods_accept_only_the_jobs_worker_pods_by_default():
    found = policies({})
    assert set(found) == {"lighthouse", "workers"}
    spec = found["workers"]["spec"]
    assert spec["podSelector"]["matchLabels"] == {contract.LABEL_ROLE: contract.ROLE_WORKER}
    assert spec["podSelector"]["matchExpressions"] == [{"key": contract.LABEL_JOB, "operator": "Exists"}]
    (rule,) = spec["ingress"]
    assert "ports" not in rule, "gloo's pair ports are ephemeral: a worker peer may use any port"
    (peer,) = rule["from"]
    assert peer["podSelector"]["matchLabels"] == {contract.LABEL_ROLE: contract.ROLE_WORKER}
    assert "namespaceSelector" not in peer, "only the policy's own namespace"


def test_workers_can_be_left_out_and_a_scraper_let_in_to_metrics_only():
    assert set(policies({"networkPolicy.workers": "false"})) == {"lighthouse"}
    found = policies({"networkPolicy.metricsFrom[0].namespaceSelector.matchLabels.kubernetes\\.io/metadata\\.name":
                      "monitoring"})  # fmt: skip
    _, scrape = found["workers"]["spec"]["ingress"]
    assert scrape == {"from": [SCRAPER], "ports": [{"protocol": "TCP", "port": contract.TRAINER_METRICS_PORT}]}
    _, scrape = found["lighthouse"]["spec"]["ingress"]
    assert scrape == {"from": [SCRAPER], "ports": [{"protocol": "TCP", "port": contract.LIGHTHOUSE_PORT}]}
