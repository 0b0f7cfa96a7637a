"""TLS on the real cluster: a job gets its own CA in the Secret <job>-tls (owned by the job); its lighthouse pod
serves only HTTPS, verified by that CA under the lighthouse Service's name when called by pod IP (as the operator
and these tests do), and refuses a client with another CA, one without any CA and plain HTTP; the workers (which
verify it with the CA mounted into their pods) reach it. A job with spec.tls.enabled=false still trains to the end."""

from __future__ import annotations

import base64
import http.client
import socket
import ssl
from pathlib import Path

import pytest
from cryptography import x509
from ftjob import contract
from ftjob.contract import pki
from ftjob.contract.tls import NamedHTTPSConnection, client_context
from ftjob.operator.state import names
from kubernetes import client

from tests.support.operator_cluster import (
    condition,
    create_job,
    get_job,
    job_manifest,
    lighthouse_pod,
    lighthouse_status,
    patch_job,
)
from tests.support.polling import wait_for
from tests.support.trainer_runs import check_run, training_job

pytestmark = pytest.mark.cluster

JOB = "tlsj"


def status_over(conn: http.client.HTTPConnection, token: str) -> int:
    conn.request("GET", contract.PATH_STATUS, headers={"Authorization": f"Bearer {token}"})
    return conn.getresponse().status


def test_job_ca_secret_and_a_lighthouse_that_speaks_only_verified_tls(kube, namespace, operators):
    operators()
    create_job(kube.custom, namespace, job_manifest(JOB))
    # both heartbeating workers reached the lighthouse over HTTPS, verified with the CA mounted into their pods,
    # and the operator's own calls did too (the lighthouse learnt the desired count from it)
    status = wait_for(lambda: (s := lighthouse_status(kube.core, namespace, JOB)) and len(s.members) == 2 and s,
                      120, "both groups in the lighthouse, over TLS")  # fmt: skip
    assert status.desired_replicas == 2

    secret = kube.core.read_namespaced_secret(names.tls_secret(JOB), namespace)
    assert set(secret.data) == set(pki.SECRET_KEYS)
    job = get_job(kube.custom, namespace, JOB)
    assert job["spec"]["tls"] == {"enabled": True}, "TLS is the apiserver's default"
    assert [o.uid for o in secret.metadata.owner_references] == [job["metadata"]["uid"]]
    ca_pem = base64.b64decode(secret.data[pki.CA_CERT]).decode()
    ca = x509.load_pem_x509_certificate(ca_pem.encode())
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    token = base64.b64decode(kube.core.read_namespaced_secret(names.token_secret(JOB), namespace).data["token"])

    pod = lighthouse_pod(kube.core, namespace, JOB)
    (volume,) = [v for v in pod.spec.volumes if v.secret is not None and v.secret.secret_name == names.tls_secret(JOB)]
    assert pki.CA_KEY not in [i.key for i in volume.secret.items], "the CA's key is never mounted"
    ip, port = pod.status.pod_ip, contract.LIGHTHOUSE_PORT
    service_name = names.lighthouse_dns_names(JOB, namespace)[0]

    # the job's CA, by pod IP, checked against the Service's DNS name: answered
    conn = NamedHTTPSConnection(ip, port, context=client_context(ca_data=ca_pem), server_name=service_name, timeout=5)
    assert status_over(conn, token.decode()) == 200
    # another CA (a certificate with the very same names): refused
    other = pki.issue_job(JOB, namespace, names.lighthouse_dns_names(JOB, namespace))[pki.CA_CERT].decode()
    wrong = NamedHTTPSConnection(ip, port, context=client_context(ca_data=other), server_name=service_name, timeout=5)
    with pytest.raises(ssl.SSLCertVerificationError):
        status_over(wrong, token.decode())
    # no job CA at all (the system trust store): refused
    system = NamedHTTPSConnection(ip, port, context=ssl.create_default_context(), server_name=service_name, timeout=5)
    with pytest.raises(ssl.SSLCertVerificationError):
        status_over(system, token.decode())
    # plain HTTP: the TLS port fails the handshake, no HTTP answer
    with socket.create_connection((ip, port), timeout=5) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        got = b""
        try:
            while chunk := s.recv(4096):
                got += chunk
        except ConnectionResetError:
            pass
    assert not got.startswith(b"HTTP/"), got

    # a running job cannot switch TLS off: its pods hold the https:// URL and the certificates
    with pytest.raises(client.ApiException) as refused:
        patch_job(kube.custom, namespace, JOB, {"spec": {"tls": {"enabled": False}}})
    assert refused.value.status == 422 and "spec.tls is immutable" in refused.value.body


def test_job_without_tls_trains_to_the_end_over_plain_http(kube, namespace, operators, records: Path):
    operators()
    steps = 30
    create_job(kube.custom, namespace, training_job("plain", steps, records, tls={"enabled": False}))
    job = wait_for(lambda: (j := get_job(kube.custom, namespace, "plain")) and (condition(j, "Succeeded")
                   or condition(j, "Failed")) and j, 420, "the job to finish")  # fmt: skip
    assert condition(job, "Succeeded"), job["status"]
    check_run(records, {"0", "1"}, steps, restarted=set())
    with pytest.raises(client.ApiException) as e:
        kube.core.read_namespaced_secret(names.tls_secret("plain"), namespace)
    assert e.value.status == 404, "no CA is issued for a plain-HTTP job"
    sel = f"{contract.LABEL_JOB}=plain,{contract.LABEL_ROLE}={contract.ROLE_WORKER}"
    for pod in kube.core.list_namespaced_pod(namespace, label_selector=sel).items:
        env = {e.name: e.value for e in pod.spec.containers[0].env}
        assert env[contract.ENV_LIGHTHOUSE_URL].startswith("http://") and contract.ENV_TLS_CA_FILE not in env
