"""TLS on the operator's side, no cluster: the per-job TLS Secret, what the pods mount (never the CA's key), the
https:// lighthouse URL and its port name, the plain-HTTP opt-out, and the operator's own lighthouse client, which
reaches a real TLS lighthouse by IP and verifies it against the job's CA and the lighthouse Service's DNS name."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509
from ftjob import contract
from ftjob.contract import pki
from ftjob.contract.tls import client_context
from ftjob.operator.lighthouse.client import LighthouseClient, LighthouseEndpoint, endpoint
from ftjob.operator.resources import manifests as builders
from ftjob.operator.state import names
from ftjob.operator.state.job_state import GroupState

from tests.support.podfactory import JOB, spec
from tests.support.polling import StopWaiting, wait_for

TOKEN = "operator-tls-token"
WORKER_TOKEN = "worker-tls-token"


def env_of(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container["env"]}


def test_tls_secret_holds_a_fresh_ca_and_the_lighthouse_and_worker_pairs():
    secret = builders.tls_secret(JOB, "ns")
    assert secret["metadata"]["name"] == names.tls_secret(JOB) == "demo-tls"
    assert secret["metadata"]["labels"][contract.LABEL_JOB] == JOB
    data = secret["stringData"]
    assert set(data) == set(pki.SECRET_KEYS)
    lighthouse = x509.load_pem_x509_certificate(data[pki.LIGHTHOUSE_CERT].encode())
    sans = lighthouse.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == names.lighthouse_dns_names(JOB, "ns")
    assert "demo-lighthouse.ns.svc.cluster.local" in builders.lighthouse_url(JOB, "ns")
    assert builders.tls_secret(JOB, "ns")["stringData"][pki.CA_CERT] != data[pki.CA_CERT]


def test_pods_mount_only_their_own_pair_read_only_and_speak_https():
    template = {"spec": {"containers": [{"name": "trainer", "image": "i"}, {"name": "side", "image": "i"}]}}
    s = spec(template=template)
    pod = builders.worker_pod(JOB, "ns", s, GroupState(index=1), rank=0)["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == builders.TLS_VOLUME]
    assert volume["secret"]["secretName"] == "demo-tls"
    assert [i["key"] for i in volume["secret"]["items"]] == [pki.CA_CERT, pki.WORKER_CERT, pki.WORKER_KEY]
    for container in pod["containers"]:  # every container gets the env, so every one gets the files
        assert {"name": builders.TLS_VOLUME, "mountPath": builders.TLS_DIR, "readOnly": True} in container[
            "volumeMounts"
        ]
        env = env_of(container)
        assert env[contract.ENV_LIGHTHOUSE_URL] == "https://demo-lighthouse.ns.svc.cluster.local:29510"
        assert env[contract.ENV_TLS_CA_FILE] == f"{builders.TLS_DIR}/{pki.CA_CERT}"
        assert env[contract.ENV_TLS_CERT_FILE] == f"{builders.TLS_DIR}/{pki.WORKER_CERT}"
        assert env[contract.ENV_TLS_KEY_FILE] == f"{builders.TLS_DIR}/{pki.WORKER_KEY}"

    lh = builders.lighthouse_pod(JOB, "ns", s, 0)["spec"]
    (volume,) = [v for v in lh["volumes"] if v["name"] == builders.TLS_VOLUME]
    assert [i["key"] for i in volume["secret"]["items"]] == [pki.CA_CERT, pki.LIGHTHOUSE_CERT, pki.LIGHTHOUSE_KEY]
    (container,) = lh["containers"]
    tls_mounts = [m for m in container["volumeMounts"] if m["name"] == builders.TLS_VOLUME]
    assert tls_mounts == [{"name": builders.TLS_VOLUME, "mountPath": builders.TLS_DIR, "readOnly": True}]
    assert container["ports"] == [{"name": "https", "containerPort": contract.LIGHTHOUSE_PORT}]
    assert env_of(container)[contract.ENV_TLS_CERT_FILE].endswith(pki.LIGHTHOUSE_CERT)
    assert pki.CA_KEY not in json.dumps([pod, lh]), "the CA's key is never mounted"


def test_tls_disabled_is_plain_http_without_any_tls_file():
    s = spec(tls={"enabled": False})
    pod = builders.worker_pod(JOB, "ns", s, GroupState(index=0), rank=0)
    lh = builders.lighthouse_pod(JOB, "ns", s, 0)
    assert env_of(pod["spec"]["containers"][0])[contract.ENV_LIGHTHOUSE_URL].startswith("http://")
    assert lh["spec"]["containers"][0]["ports"][0]["name"] == "http"
    assert "volumes" not in pod["spec"]
    assert [v["name"] for v in lh["spec"]["volumes"]] == [builders.LIGHTHOUSE_SCRATCH_VOLUME], "no TLS volume"
    assert "FTJOB_TLS_" not in json.dumps([pod, lh])
    with pytest.raises(ValueError, match=r"spec.tls.enabled must be true or false"):
        spec(tls={"enabled": "no"})


# --- the operator's client against a real lighthouse ---------------------------------------------------------------
@pytest.fixture
def tls_lighthouse(tmp_path: Path) -> Iterator[tuple[int, dict[str, Path]]]:
    """A lighthouse with the certificate the operator would issue for job demo in namespace ns: it names the
    Service's DNS names only, no IP address, yet the operator calls it by IP."""
    files = pki.write_files(tmp_path / "tls", pki.issue_job(JOB, "ns", names.lighthouse_dns_names(JOB, "ns")))
    log = tmp_path / "lighthouse.log"
    env = {**os.environ, contract.ENV_TOKEN: WORKER_TOKEN, contract.ENV_OPERATOR_TOKEN: TOKEN}
    cmd = [sys.executable, "-m", "ftjob.lighthouse", "--bind", "127.0.0.1:0", "--tls-cert",
           str(files[pki.LIGHTHOUSE_CERT]), "--tls-key", str(files[pki.LIGHTHOUSE_KEY])]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)

    def listening() -> re.Match[str] | None:
        if proc.poll() is not None:
            raise StopWaiting(f"the lighthouse exited {proc.returncode}: {log.read_text()}")
        return re.search(r"listening on 127\.0\.0\.1:(\d+) over TLS", log.read_text())

    m = wait_for(listening, 60, "the TLS lighthouse to listen", interval=0.05)
    yield int(m.group(1)), files
    proc.kill()
    proc.wait(30)


def test_operator_reaches_a_tls_lighthouse_by_ip_verifying_the_service_name(tls_lighthouse):
    port, files = tls_lighthouse
    service_name = names.lighthouse_dns_names(JOB, "ns")[0]
    ca = client_context(ca_data=files[pki.CA_CERT].read_text())
    another_job = pki.issue_job(JOB, "ns", names.lighthouse_dns_names(JOB, "ns"))  # the same names, another CA
    other = client_context(ca_data=another_job[pki.CA_CERT].decode())
    url = f"https://127.0.0.1:{port}"

    async def calls() -> dict[str, object]:
        client = LighthouseClient()
        job, wrong_ca = LighthouseEndpoint(url, ca, service_name), LighthouseEndpoint(url, other, service_name)
        try:
            return {
                "job CA": await client.status(job, TOKEN),
                "job CA, desired": await client.desired(job, TOKEN, 1, 2),
                "another CA": await client.status(wrong_ca, TOKEN),
                "another CA, evict": await client.evict(wrong_ca, TOKEN, [0], "test"),
                "wrong name": await client.status(LighthouseEndpoint(url, ca, "somewhere.else"), TOKEN),
                "plain HTTP": await client.status(LighthouseEndpoint(f"http://127.0.0.1:{port}"), TOKEN),
            }
        finally:
            await client.close()

    got = asyncio.run(calls())
    assert got["job CA"] is not None and got["job CA, desired"] is True
    assert got["another CA"] is None and got["another CA, evict"] is False
    assert got["wrong name"] is None and got["plain HTTP"] is None
    assert endpoint("10.0.0.7", ca, service_name) == LighthouseEndpoint("https://10.0.0.7:29510", ca, service_name)
    assert endpoint("10.0.0.7").url == "http://10.0.0.7:29510"
