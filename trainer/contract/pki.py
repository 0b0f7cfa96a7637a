"""Issuing a job's certificates: a per-job CA and two server certificates it signs, the lighthouse's (its Service's
DNS names) and the workers' (``tls.worker_server_name``: recovery servers are reached by pod IP). ECDSA P-256,
valid VALIDITY from a few minutes in the past (nodes' clocks differ a little).

Here, in the contract package, because both issuers import it without torch: the operator (one Secret per job,
SECRET_KEYS) and the local launcher (``ftjob-trainer launch --tls``, files in the run directory); tests too. The X.509
work is the ``cryptography`` package's; this module only chooses names, key usages and lifetimes.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from ftjob.contract.tls import worker_server_name

MAX_COMMON_NAME = 64  # X.509's bound; names are checked against the SANs, the common name is only a label
VALIDITY = dt.timedelta(days=365)  # a job longer than a year is re-created; nothing here rotates certificates
CLOCK_SKEW = dt.timedelta(minutes=5)

# The files of a job's TLS Secret (and of the launcher's run-dir folder). ca.key is kept for re-issuing only and is
# never mounted; the lighthouse pod gets CA + lighthouse pair, worker pods CA + worker pair.
CA_CERT, CA_KEY = "ca.crt", "ca.key"
LIGHTHOUSE_CERT, LIGHTHOUSE_KEY = "lighthouse.crt", "lighthouse.key"
WORKER_CERT, WORKER_KEY = "worker.crt", "worker.key"
SECRET_KEYS = (CA_CERT, CA_KEY, LIGHTHOUSE_CERT, LIGHTHOUSE_KEY, WORKER_CERT, WORKER_KEY)


@dataclass(frozen=True)
class Issued:
    """A certificate and its private key, PEM."""

    cert: bytes
    key: bytes


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _builder(subject: x509.Name, issuer: x509.Name, public: ec.EllipticCurvePublicKey) -> x509.CertificateBuilder:
    now = dt.datetime.now(dt.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(now + VALIDITY)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
    )


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name[:MAX_COMMON_NAME])])


def issue_ca(common_name: str) -> tuple[Issued, x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A CA that may sign server certificates only (path length 0)."""
    key = _new_key()
    name = _name(common_name)
    usage = x509.KeyUsage(False, False, False, False, False, True, True, False, False)  # keyCertSign, cRLSign
    cert = (
        _builder(name, name, key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(usage, critical=True)
        .sign(key, hashes.SHA256())
    )
    return Issued(cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)), cert, key


def issue_server(
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    common_name: str,
    dns_names: Iterable[str],
    ips: Iterable[str] = (),
) -> Issued:
    """A TLS server certificate for ``dns_names`` and IP addresses ``ips`` (its subject alternative names)."""
    sans: list[x509.GeneralName] = [x509.DNSName(n) for n in dns_names]
    sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
    if not sans:
        raise ValueError("a server certificate needs at least one DNS name or IP address")
    key = _new_key()
    subject = _name(common_name)
    usage = x509.KeyUsage(True, False, False, False, False, False, False, False, False)  # digitalSignature
    ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    cert = (
        _builder(subject, ca_cert.subject, key.public_key())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(usage, critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return Issued(cert.public_bytes(serialization.Encoding.PEM), _pem_key(key))


def issue_job(job: str, namespace: str, lighthouse_names: Iterable[str], lighthouse_ips: Iterable[str] = ()
              ) -> dict[str, bytes]:  # fmt: skip
    """A fresh CA and the job's two server certificates, as the files SECRET_KEYS name (PEM bytes)."""
    ca, ca_cert, ca_key = issue_ca(f"ftjob CA {namespace}/{job}")
    lighthouse = issue_server(ca_cert, ca_key, f"ftjob lighthouse {namespace}/{job}", lighthouse_names, lighthouse_ips)
    worker = issue_server(ca_cert, ca_key, f"ftjob worker {namespace}/{job}", [worker_server_name(job, namespace)])
    return {
        CA_CERT: ca.cert,
        CA_KEY: ca.key,
        LIGHTHOUSE_CERT: lighthouse.cert,
        LIGHTHOUSE_KEY: lighthouse.key,
        WORKER_CERT: worker.cert,
        WORKER_KEY: worker.key,
    }


def write_files(directory: Path, files: dict[str, bytes]) -> dict[str, Path]:
    """Writes ``files`` into ``directory`` (created, owner-only); keys are owner-readable only. Returns the paths."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    paths = {}
    for name, data in files.items():
        path = directory / name
        path.write_bytes(data)
        path.chmod(0o600 if name.endswith(".key") else 0o644)
        paths[name] = path
    return paths
