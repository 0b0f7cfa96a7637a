"""Unit tests of the node agent's pure logic: DNS tables, pod phase, commands, env, IPs, config errors."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "hack" / "nodeagent"))

from nodeagent.commands import NoCommandError, container_argv, expand_refs
from nodeagent.config import ConfigError, parse_config
from nodeagent.dns import build_hosts_table, hosts_file_text
from nodeagent.envvars import ConfigMissingError, container_env
from nodeagent.logserver import latest_log, tail_bytes
from nodeagent.network import IpAllocator, host_veth_name, netns_name
from nodeagent.podstatus import pod_phase


def _pod(name: str, ns: str, ip: str | None, ready: bool, labels: dict, **spec: str) -> dict:
    status: dict = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if ip:
        status["podIP"] = ip
    return {"metadata": {"name": name, "namespace": ns, "labels": labels}, "spec": spec, "status": status}


def _svc(name: str, ns: str, selector: dict, headless: bool = True, publish: bool = False) -> dict:
    spec = {"clusterIP": "None" if headless else "10.0.0.9", "selector": selector, "publishNotReadyAddresses": publish}
    return {"metadata": {"name": name, "namespace": ns}, "spec": spec}


def test_headless_service_maps_ready_pods_and_hostname_subdomain_names() -> None:
    pods = [
        _pod("w0", "a", "10.1.0.2", True, {"app": "w"}, hostname="w0", subdomain="peers"),
        _pod("w1", "a", "10.1.0.3", False, {"app": "w"}, hostname="w1", subdomain="peers"),
        _pod("other", "b", "10.1.0.4", True, {"app": "w"}),
    ]
    table = build_hosts_table([_svc("peers", "a", {"app": "w"})], pods, "cluster.local")

    assert "10.1.0.2\tpeers.a.svc.cluster.local peers.a.svc peers.a" in table.common
    assert "10.1.0.2\tw0.peers.a.svc.cluster.local w0.peers.a.svc w0.peers.a" in table.common
    assert "10.1.0.3" not in table.common  # not Ready and the Service does not publish not-ready addresses
    assert "10.1.0.4" not in table.common  # another namespace
    assert table.per_namespace["a"].splitlines() == ["10.1.0.2\tpeers", "10.1.0.2\tw0.peers"]


def test_publish_not_ready_addresses_resolves_pods_as_soon_as_they_have_an_ip() -> None:
    pods = [
        _pod("w0", "a", "10.1.0.2", False, {"app": "w"}, hostname="w0", subdomain="peers"),
        _pod("w1", "a", None, False, {"app": "w"}, hostname="w1", subdomain="peers"),
    ]
    table = build_hosts_table([_svc("peers", "a", {"app": "w"}, publish=True)], pods, "cluster.local")

    assert "10.1.0.2\tw0.peers.a.svc.cluster.local" in table.common
    assert "w1.peers" not in table.common


def test_clusterip_service_maps_one_ready_backend_and_ignores_terminating_pods() -> None:
    terminating = _pod("a0", "a", "10.1.0.2", True, {"app": "x"})
    terminating["metadata"]["deletionTimestamp"] = "2024-01-01T00:00:00Z"
    pods = [
        terminating,
        _pod("a1", "a", "10.1.0.3", True, {"app": "x"}),
        _pod("a2", "a", "10.1.0.4", True, {"app": "x"}),
    ]
    table = build_hosts_table([_svc("api", "a", {"app": "x"}, headless=False)], pods, "cluster.local")

    assert table.common == "10.1.0.3\tapi.a.svc.cluster.local api.a.svc api.a"


def test_hosts_file_has_localhost_own_name_and_same_namespace_short_names_only() -> None:
    pods = [_pod("w0", "a", "10.1.0.2", True, {"app": "w"})]
    table = build_hosts_table([_svc("peers", "a", {"app": "w"})], pods, "cluster.local")
    me = _pod("me", "b", "10.1.0.9", True, {}, hostname="h", subdomain="s")

    text = hosts_file_text(me, "10.1.0.9", table, "cluster.local")

    assert "127.0.0.1\tlocalhost" in text
    assert "10.1.0.9\th.s.b.svc.cluster.local h" in text
    assert "peers.a.svc" in text
    assert "\tpeers\n" not in text  # `peers` alone resolves only inside namespace a


@pytest.mark.parametrize(
    ("codes", "policy", "want"),
    [
        ([0, 0], "Never", "Succeeded"),
        ([0, 1], "Never", "Failed"),
        ([0, 1], "OnFailure", "Running"),
        ([0, 0], "OnFailure", "Succeeded"),
        ([0, 0], "Always", "Running"),
    ],
)
def test_pod_phase_from_terminated_containers(codes: list[int], policy: str, want: str) -> None:
    main = [{"state": {"terminated": {"exitCode": c}}, "started": False} for c in codes]
    assert pod_phase([], main, False, policy) == want


def test_pod_phase_pending_until_init_done_and_failed_when_init_fails() -> None:
    running_init = [{"state": {"running": {}}}]
    waiting = [{"state": {"waiting": {}}, "started": False}]
    assert pod_phase(running_init, waiting, False, "Never") == "Pending"
    assert pod_phase([{"state": {"terminated": {"exitCode": 0}}}], waiting, False, "Never") == "Pending"
    assert pod_phase([{"state": {"terminated": {"exitCode": 1}}}], waiting, True, "Never") == "Failed"


def test_command_mapping_and_var_expansion() -> None:
    env = {"A": "1"}
    assert container_argv({"command": ["echo", "$(A)", "$$(A)", "$(B)"]}, env) == ["echo", "1", "$(A)", "$(B)"]
    assert container_argv({"image": "reg/ftjob-trainer:dev", "args": ["--x"]}, env) == ["ftjob-trainer", "--x"]
    assert container_argv({"image": "ftjob-operator"}, env) == ["ftjob-operator"]
    with pytest.raises(NoCommandError, match="set `command`"):
        container_argv({"name": "c", "image": "busybox"}, env)
    assert expand_refs("$(A)$(A)", env) == "11"


def test_env_resolution_order_and_missing_references() -> None:
    store = {("configmap", "ns", "cm"): {"k": "from-cm", "x": "1"}, ("secret", "ns", "s"): {"pw": "p"}}

    async def fetch(kind: str, ns: str, name: str) -> dict[str, str] | None:
        return store.get((kind, ns, name))

    pod = {"metadata": {"name": "p", "namespace": "ns", "uid": "u", "labels": {"team": "ml"}}, "spec": {}, "status": {}}
    container = {
        "envFrom": [{"configMapRef": {"name": "cm"}, "prefix": "CM_"}],
        "env": [
            {"name": "CM_k", "value": "override"},
            {"name": "PW", "valueFrom": {"secretKeyRef": {"name": "s", "key": "pw"}}},
            {"name": "TEAM", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['team']"}}},
            {"name": "OPT", "valueFrom": {"secretKeyRef": {"name": "nope", "key": "k", "optional": True}}},
        ],
    }
    env = asyncio.run(container_env(pod, container, fetch, base={"BASE": "b"}, node_ip="10.0.0.1"))
    assert env == {"BASE": "b", "CM_k": "override", "CM_x": "1", "PW": "p", "TEAM": "ml"}

    missing = {"env": [{"name": "X", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "absent"}}}]}
    with pytest.raises(ConfigMissingError, match="key 'absent' not in configmap ns/cm"):
        asyncio.run(container_env(pod, missing, fetch, base={}, node_ip="10.0.0.1"))


def test_ip_allocator_round_robin_skips_gateway_and_reports_exhaustion() -> None:
    ips = IpAllocator("10.9.0.0/29", "10.9.0.1")
    first = [ips.allocate() for _ in range(5)]
    assert first == ["10.9.0.2", "10.9.0.3", "10.9.0.4", "10.9.0.5", "10.9.0.6"]
    with pytest.raises(RuntimeError, match="exhausted"):
        ips.allocate()
    ips.release("10.9.0.3")
    assert ips.allocate() == "10.9.0.3"


def test_netns_and_veth_names_fit_interface_limits() -> None:
    uid = "14378fe9-2e17-4386-9197-8c7f1f1f36a8"
    assert netns_name("ftj-p", uid) == "ftj-p14378fe92e" and len(netns_name("ftj-p", uid)) <= 15
    assert len(host_veth_name(uid)) <= 15


def test_config_errors_name_the_field_to_fix(tmp_path: Path) -> None:
    good = {
        "node_name": "n",
        "node_ip": "10.0.0.11",
        "pod_cidr": "10.0.1.0/24",
        "pod_gateway": "10.0.1.1",
        "pod_bridge": "br",
        "api_server": "https://10.0.0.1:6443",
        "kubeconfig": "k",
        "state_dir": str(tmp_path),
        "venv": "/v",
        "repo": "/r",
    }
    assert parse_config(good).kubelet_port == 10250
    with pytest.raises(ConfigError, match=r"missing required field.*kubeconfig"):
        parse_config({**good, "kubeconfig": ""})
    with pytest.raises(ConfigError, match=r"pod_gateway 10\.0\.2\.1 is outside pod_cidr"):
        parse_config({**good, "pod_gateway": "10.0.2.1"})
    with pytest.raises(ConfigError, match="gpus must be an integer"):
        parse_config({**good, "gpus": "eight"})


def test_log_tail_and_previous_run_selection(tmp_path: Path) -> None:
    assert tail_bytes(b"a\nb\nc\n", 2) == b"b\nc\n"
    assert tail_bytes(b"a\nb\n", -1) == b"a\nb\n"
    for n in (0, 1, 10):
        (tmp_path / f"{n}.log").write_text(str(n))
    assert latest_log(tmp_path, previous=False).name == "10.log"  # numeric, not lexical, order
    assert latest_log(tmp_path, previous=True).name == "1.log"


def test_dns_writer_shares_one_file_per_namespace_and_isolates_duplicate_hostnames(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import nodeagent.dns as dns

    monkeypatch.setattr(dns, "NETNS_ETC_DIR", tmp_path / "etc-netns")
    pods = [
        _pod("a", "ns1", "10.1.0.2", True, {"app": "w"}, hostname="w0", subdomain="peers"),
        _pod("b", "ns1", "10.1.0.3", True, {"app": "w"}, hostname="w1", subdomain="peers"),
        _pod("c", "ns1", "10.1.0.4", True, {}, hostname="w0", subdomain="other"),  # same bare hostname as a
    ]
    services = [_svc("peers", "ns1", {"app": "w"})]
    writer = dns.DnsWriter("cluster.local", lambda: services, lambda: pods, shared_dir=tmp_path / "shared")
    for i, p in enumerate(pods):
        writer.add_pod(f"p{i}", p, p["status"]["podIP"])
    writer.refresh()

    etc = tmp_path / "etc-netns"
    assert (etc / "p0" / "hosts").resolve() == (etc / "p1" / "hosts").resolve() == tmp_path / "shared" / "ns1.hosts"
    assert not (etc / "p2" / "hosts").is_symlink()
    shared = (tmp_path / "shared" / "ns1.hosts").read_text()
    assert "10.1.0.2\tw0.peers.ns1.svc.cluster.local w0\n" in shared and "10.1.0.4" not in shared
    private = (etc / "p2" / "hosts").read_text()
    assert "10.1.0.4\tw0.other.ns1.svc.cluster.local w0" in private.splitlines()[3]  # own name before the rest
    assert "w1.peers.ns1.svc.cluster.local" in private

    inode = (tmp_path / "shared" / "ns1.hosts").stat().st_ino
    pods[1]["status"]["podIP"] = "10.1.0.9"  # the file is bind-mounted: it must change in place
    writer.refresh()
    assert (tmp_path / "shared" / "ns1.hosts").stat().st_ino == inode
    assert "10.1.0.9\tw1.peers.ns1.svc.cluster.local" in (tmp_path / "shared" / "ns1.hosts").read_text()


def test_pod_status_conditions_follow_readiness_and_keep_transition_times() -> None:
    from nodeagent.podstatus import ConditionClock, PodFacts, build_pod_status

    clock = ConditionClock()
    clock.seed([{"type": "Ready", "status": "False", "lastTransitionTime": "2020-01-01T00:00:00Z"}])
    running = {"state": {"running": {"startedAt": "x"}}, "started": True, "ready": False}
    facts = PodFacts([], [running], "Always", False, True, True, "10.0.0.11", "10.1.0.2", "t0", "")

    first = build_pod_status(facts, clock)
    conditions = {c["type"]: c for c in first["conditions"]}
    assert first["phase"] == "Running" and first["podIP"] == "10.1.0.2"
    assert conditions["Ready"]["status"] == "False" and conditions["Ready"]["reason"] == "ContainersNotReady"
    assert conditions["Ready"]["lastTransitionTime"] == "2020-01-01T00:00:00Z"  # unchanged status keeps its time

    facts.main = [{**running, "ready": True}]
    ready = {c["type"]: c for c in build_pod_status(facts, clock)["conditions"]}
    assert ready["Ready"]["status"] == "True" and ready["Ready"]["lastTransitionTime"] != "2020-01-01T00:00:00Z"

    facts.init_failed, facts.message = True, "node agent could not start the pod: boom"
    failed = build_pod_status(facts, clock)
    assert failed["phase"] == "Failed" and "boom" in failed["message"]
