"""TLS for the lighthouse API and the recovery servers: the SSL contexts both ends build from the env contract, and
the name every worker's certificate carries.

With FTJOB_TLS_CA_FILE set, a process trusts only the job's CA (never the system's store) and talks TLS 1.2+ to the
lighthouse and to its peers' recovery servers; its own servers present FTJOB_TLS_CERT_FILE / FTJOB_TLS_KEY_FILE.
Recovery servers are reached by pod IP, so a recovery client checks the certificate against ``worker_server_name``
(one fixed DNS name per job, in the worker certificate only): a lighthouse certificate cannot pose as a worker, nor a
worker's as the lighthouse (its certificate carries the lighthouse Service's DNS names). Clients authenticate with
the job's bearer token, not a certificate. Issuing the certificates: ``ftjob.contract.pki``. No torch here.
"""

from __future__ import annotations

import http.client
import os
import ssl
from dataclasses import dataclass
from functools import cached_property

from ftjob import contract

MIN_VERSION = ssl.TLSVersion.TLSv1_2
WORKER_NAME_DOMAIN = "ftjob.dev"  # ours (the API group's domain): no real host is ever named like a worker


def worker_server_name(job: str, namespace: str) -> str:
    """The DNS name in a job's worker certificate, which recovery clients pass as the expected server name."""
    return f"worker.{job}.{namespace}.{WORKER_NAME_DOMAIN}"


def client_context(ca_file: str | None = None, *, ca_data: str | None = None) -> ssl.SSLContext:
    """Verifies servers (certificate and name) against the job's CA only; with neither argument, against the
    system's trust store (which never holds a job's CA: such a client cannot talk to a job's servers)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # CERT_REQUIRED and check_hostname by default
    ctx.minimum_version = MIN_VERSION
    if ca_file is None and ca_data is None:
        ctx.load_default_certs()
    else:
        ctx.load_verify_locations(cafile=ca_file, cadata=ca_data)
    return ctx


def server_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    """Presents this server's certificate chain; clients are not asked for one (the bearer token authenticates)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = MIN_VERSION
    ctx.load_cert_chain(cert_file, key_file)
    return ctx


@dataclass(frozen=True)
class TlsConfig:
    """A trainer process's TLS settings (the env contract's FTJOB_TLS_* files and the job's worker name)."""

    ca_file: str | None  # None: the system trust store (tests: a client without the job's CA)
    cert_file: str | None = None
    key_file: str | None = None
    worker_name: str = worker_server_name("local", "default")

    @classmethod
    def from_environ(cls, environ: dict[str, str] | os._Environ[str] | None = None) -> TlsConfig | None:
        """None when FTJOB_TLS_CA_FILE is unset (plain HTTP: local development only)."""
        env = os.environ if environ is None else environ
        ca = env.get(contract.ENV_TLS_CA_FILE) or None
        cert, key = env.get(contract.ENV_TLS_CERT_FILE) or None, env.get(contract.ENV_TLS_KEY_FILE) or None
        if ca is None:
            if cert or key:
                raise ValueError(
                    f"{contract.ENV_TLS_CERT_FILE}/{contract.ENV_TLS_KEY_FILE} are set but {contract.ENV_TLS_CA_FILE} "
                    "is not: set the job's CA too (every TLS client verifies its server with it)"
                )
            return None
        # the same defaults as contract.WorkerEnv
        name = worker_server_name(env.get(contract.ENV_JOB_NAME, "local"), env.get(contract.ENV_NAMESPACE, "default"))
        return cls(ca_file=ca, cert_file=cert, key_file=key, worker_name=name)

    @cached_property
    def client_context(self) -> ssl.SSLContext:
        return client_context(self.ca_file)

    @cached_property
    def server_context(self) -> ssl.SSLContext:
        if not (self.cert_file and self.key_file):
            raise ValueError(
                f"{contract.ENV_TLS_CA_FILE} is set but {contract.ENV_TLS_CERT_FILE} and {contract.ENV_TLS_KEY_FILE} "
                "are not: this process's recovery server needs the job's worker certificate and key"
            )
        return server_context(self.cert_file, self.key_file)


class NamedHTTPSConnection(http.client.HTTPSConnection):
    """HTTPS to an address (a pod IP) whose certificate is checked against ``server_name`` instead of the host."""

    def __init__(
        self, host: str, port: int, *, context: ssl.SSLContext, server_name: str, timeout: float | None = None
    ) -> None:
        super().__init__(host, port, timeout=timeout, context=context)
        self.server_name = server_name

    def connect(self) -> None:
        http.client.HTTPConnection.connect(self)  # TCP (no proxy tunnel: peers are reached directly)
        self.sock = self._context.wrap_socket(self.sock, server_hostname=self.server_name)  # type: ignore[attr-defined]
