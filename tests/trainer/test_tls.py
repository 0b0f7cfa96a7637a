"""TLS: the lighthouse and the recovery servers speak only TLS with the job's certificates, and only a
client holding the job's CA gets through; one without it (the system trust store), one with another job's CA and
plain HTTP are refused. Also what the certificates carry and how the env contract turns TLS on."""

from __future__ import annotations

import http.client
import socket
import ssl
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from ftjob import contract
from ftjob.contract import pki
from ftjob.contract.lighthouse_api import QuorumRequest
from ftjob.contract.tls import TlsConfig, worker_server_name
from ftjob.ft.links.lighthouse_client import LighthouseClient, LighthouseTlsError
from ftjob.ft.recovery.transport import RecoveryError, RecoveryServer, fetch_state
from test_recovery import assert_same, sample_state

from tests.support.local_job import TOKEN, Lighthouse

LOOPBACK = (["localhost"], ["127.0.0.1"])  # the launcher's lighthouse names


@pytest.fixture(scope="module")
def job_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return pki.write_files(tmp_path_factory.mktemp("job"), pki.issue_job("local", "default", *LOOPBACK))


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another job's CA, whose certificates carry the very same names: only the CA tells them apart."""
    files = pki.write_files(tmp_path_factory.mktemp("other"), pki.issue_job("local", "default", *LOOPBACK))
    return files[pki.CA_CERT]


def job_client(files: dict[str, Path]) -> TlsConfig:
    return TlsConfig(ca_file=str(files[pki.CA_CERT]))


def refusing_clients(other_ca: Path) -> dict[str, TlsConfig]:
    return {"system trust store": TlsConfig(ca_file=None), "another job's CA": TlsConfig(ca_file=str(other_ca))}


def no_http_answer(address: tuple[str, int]) -> bytes:
    """What a TLS port sends back to a plain-HTTP request: it fails the handshake, so never an HTTP response."""
    with socket.create_connection(address, timeout=10) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        got = b""
        try:
            while chunk := s.recv(4096):  # until the server closes the connection
                got += chunk
        except ConnectionResetError:  # closed with unread bytes (the rest of the request) pending: a reset
            pass
    assert not got.startswith(b"HTTP/"), got
    return got


def quorum_request() -> QuorumRequest:
    return QuorumRequest(group="0", incarnation="inc-0", step=0, quorum_id=-1, address="127.0.0.1:1",
                         store_address="127.0.0.1:2")  # fmt: skip


# --- the lighthouse ------------------------------------------------------------------------------------------------
@pytest.fixture
def tls_lighthouse(tmp_path: Path, job_files: dict[str, Path]):
    cert, key = str(job_files[pki.LIGHTHOUSE_CERT]), str(job_files[pki.LIGHTHOUSE_KEY])
    lh = Lighthouse(tmp_path, "--min-replicas", "1", "--tls-cert", cert, "--tls-key", key).start()
    yield lh
    lh.kill()


def test_lighthouse_serves_tls_to_a_client_with_the_job_ca(tls_lighthouse: Lighthouse, job_files):
    assert "over TLS" in next(tls_lighthouse.workdir.glob("lighthouse-*.log")).read_text()
    client = LighthouseClient(
        f"https://127.0.0.1:{tls_lighthouse.port}", TOKEN, "0", "inc-0", tls=job_client(job_files)
    )
    client.start()
    try:
        assert client.status().max_step == 0
        assert client.watch_connected.wait(30), "the watch WebSocket (wss://) never opened"
        assert client.quorum(quorum_request(), timeout_s=30).replica_world_size == 1
    finally:
        client.close()
    ctx = ssl.create_default_context(cafile=str(job_files[pki.CA_CERT]))  # any TLS client with the CA
    with urllib.request.urlopen(f"https://127.0.0.1:{tls_lighthouse.port}/healthz", timeout=10, context=ctx) as r:
        assert r.read() == b"ok"


def test_lighthouse_refuses_clients_without_the_job_ca(tls_lighthouse: Lighthouse, other_ca: Path):
    url = f"https://127.0.0.1:{tls_lighthouse.port}"
    for what, tls in refusing_clients(other_ca).items():
        client = LighthouseClient(url, TOKEN, "0", "inc-0", tls=tls, lost_timeout_s=600).start()
        try:
            with pytest.raises(LighthouseTlsError, match="CERTIFICATE_VERIFY_FAILED"):
                client.status()
            # a quorum request fails at once too: a certificate that is not the job's is no outage to wait out
            with pytest.raises(LighthouseTlsError, match="CERTIFICATE_VERIFY_FAILED"):
                client.quorum_async(quorum_request(), timeout_s=300).result(60)
        finally:
            client.close()
        assert not client.watch_connected.is_set(), what
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        urllib.request.urlopen(f"{url}/healthz", timeout=10)  # the system trust store


def test_plain_http_to_the_tls_lighthouse_gets_no_http_answer(tls_lighthouse: Lighthouse):
    no_http_answer(("127.0.0.1", tls_lighthouse.port))
    with pytest.raises((urllib.error.URLError, http.client.HTTPException, OSError)):
        urllib.request.urlopen(f"http://127.0.0.1:{tls_lighthouse.port}/healthz", timeout=10)


def test_a_client_with_a_ca_refuses_a_plain_lighthouse(tmp_path: Path, job_files):
    with pytest.raises(ValueError, match=r"not https:// but FTJOB_TLS_CA_FILE is set"):
        LighthouseClient("http://127.0.0.1:1", TOKEN, "0", "inc-0", tls=job_client(job_files))
    plain = Lighthouse(tmp_path, "--min-replicas", "1").start()  # a lighthouse without TLS behind an https:// URL
    client = LighthouseClient(f"https://127.0.0.1:{plain.port}", TOKEN, "0", "inc-0", tls=job_client(job_files))
    try:
        with pytest.raises(LighthouseTlsError, match="TLS with the lighthouse"):
            client.start().status()
    finally:
        client.close()
        plain.kill()


# --- the recovery servers ------------------------------------------------------------------------------------------
def recovery_server(files: dict[str, Path], cert: str = pki.WORKER_CERT, key: str = pki.WORKER_KEY) -> RecoveryServer:
    tls = TlsConfig(str(files[pki.CA_CERT]), str(files[cert]), str(files[key]), worker_server_name("local", "default"))
    server = RecoveryServer(TOKEN, "127.0.0.1", 0, chunk_bytes=4096, tls=tls)  # small chunks: many requests
    server.publish(7, sample_state())
    return server


def test_recovery_over_tls_with_the_job_ca(job_files):
    server = recovery_server(job_files)
    silent = socket.create_connection(("127.0.0.1", int(server.address.split(":")[1])))  # never says a word
    try:
        state, stats = fetch_state(server.address, 7, TOKEN, parallel=4, tls=job_client(job_files))
        assert_same(sample_state(), state)
        assert stats.chunks > 4 and stats.retries == 0  # the parallel chunk fetch, over TLS
    finally:
        silent.close()
        server.close()


def test_recovery_refuses_clients_without_the_job_ca_and_plain_http(job_files, other_ca: Path):
    server = recovery_server(job_files)
    try:
        for what, tls in refusing_clients(other_ca).items():
            with pytest.raises(RecoveryError, match=r"certificate failed verification.*CA in") as e:
                fetch_state(server.address, 7, TOKEN, tls=tls)
            assert ("system trust store" in str(e.value)) == (tls.ca_file is None), what
        with pytest.raises(RecoveryError, match="failed"):
            fetch_state(server.address, 7, TOKEN, tls=None)  # plain HTTP
        host, port = server.address.split(":")
        no_http_answer((host, int(port)))
    finally:
        server.close()


def test_a_lighthouse_certificate_cannot_pose_as_a_worker(job_files):
    """Same CA, wrong name: the recovery client expects the job's worker name, which only worker.crt carries."""
    server = recovery_server(job_files, pki.LIGHTHOUSE_CERT, pki.LIGHTHOUSE_KEY)
    try:
        with pytest.raises(RecoveryError, match="Hostname mismatch"):
            fetch_state(server.address, 7, TOKEN, tls=job_client(job_files))
    finally:
        server.close()


# --- certificates and the env contract -----------------------------------------------------------------------------
def test_job_certificates_chain_to_a_per_job_ca_and_carry_the_right_names():
    files = pki.issue_job("train", "team-a", ["train-lighthouse.team-a.svc.cluster.local", "train-lighthouse"])
    assert set(files) == set(pki.SECRET_KEYS)
    ca = x509.load_pem_x509_certificate(files[pki.CA_CERT])
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for cert_key, names in (
        (pki.LIGHTHOUSE_CERT, ["train-lighthouse.team-a.svc.cluster.local", "train-lighthouse"]),
        (pki.WORKER_CERT, ["worker.train.team-a.ftjob.dev"]),
    ):
        cert = x509.load_pem_x509_certificate(files[cert_key])
        cert.verify_directly_issued_by(ca)
        assert (
            cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
            == names
        )
        assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        assert isinstance(cert.public_key(), ec.EllipticCurvePublicKey) and cert.public_key().curve.name == "secp256r1"
        assert cert.not_valid_after_utc - cert.not_valid_before_utc <= pki.VALIDITY + pki.CLOCK_SKEW
    other = pki.issue_job("train", "team-a", ["x"])
    assert other[pki.CA_CERT] != files[pki.CA_CERT], "every call issues a fresh CA"
    # the longest names Kubernetes allows (a 40-character job, a 63-character namespace): X.509 takes them too
    job, namespace = "j" * 40, "n" * 63
    longest = pki.issue_job(job, namespace, [f"{job}-lighthouse.{namespace}.svc.cluster.local"])
    worker = x509.load_pem_x509_certificate(longest[pki.WORKER_CERT])
    sans = worker.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == [worker_server_name(job, namespace)]


def test_tls_is_on_exactly_when_the_env_names_a_ca():
    assert TlsConfig.from_environ({}) is None
    env = {
        contract.ENV_TLS_CA_FILE: "/t/ca.crt",
        contract.ENV_TLS_CERT_FILE: "/t/worker.crt",
        contract.ENV_TLS_KEY_FILE: "/t/worker.key",
        contract.ENV_JOB_NAME: "train",
        contract.ENV_NAMESPACE: "team-a",
    }
    tls = TlsConfig.from_environ(env)
    assert tls == TlsConfig("/t/ca.crt", "/t/worker.crt", "/t/worker.key", "worker.train.team-a.ftjob.dev")
    with pytest.raises(ValueError, match="FTJOB_TLS_CA_FILE is not"):
        TlsConfig.from_environ({contract.ENV_TLS_CERT_FILE: "/t/worker.crt"})
    with pytest.raises(ValueError, match="recovery server needs"):
        _ = TlsConfig(ca_file="/t/ca.crt").server_context
