"""Who may call what on the lighthouse: two bearer tokens, one per role, and least privilege for each.

  worker token    the job's Secret <job>-ftjob-token, FTJOB_TOKEN in every worker pod (and the lighthouse's): what a
                  replica group's process needs and nothing more
  operator token  the Secret <job>-ftjob-operator-token, FTJOB_OPERATOR_TOKEN in the lighthouse pod only (and read by
                  the operator): the membership API, which decides who trains

  path                                      worker token         operator token
  POST /v1/quorum, /v1/heartbeat            yes                  403 (the operator never acts as a group)
  GET  /v1/watch (WebSocket)                yes                  403
  POST /v1/membership/{evict,starting,      403 (the operator's  yes
        desired,handover}                   call)
  GET  /v1/status, /metrics                 yes (read-only)      yes (the operator polls the status)
  GET  /healthz                             no token needed
  no token or another one: 401. A refused call changes nothing and is audited with who sent it.

So code running in a worker pod -- all of which holds the worker token -- cannot raise the job's group bound, announce
phantom groups, evict healthy ones or hand them over; with the worker token it can only speak for a group id the
operator declared (QuorumCore.check_group: 403 for any other, before any change).

Why a second bearer token rather than client certificates: the operator already authenticates the lighthouse (it
verifies the server certificate against the job's CA), so only the caller's side is missing, and a token gives it
with what both ends already do. A client certificate would need the lighthouse to request and check peer certificates
and map each request's certificate to a role (aiohttp offers no per-route client authentication), the operator to
hold a key pair per job, and -- with spec.tls.enabled false or the local launcher's plain HTTP -- would give no
separation at all, where a token works the same over HTTP and HTTPS. A token is also revocable per job by replacing
one Secret, with no CA to re-issue; and it is no weaker here, since the job CA's key sits in a Secret of the same
namespace as the token's.
"""

from __future__ import annotations

import hmac
from typing import Literal

from ftjob import contract

Role = Literal["worker", "operator"]
WORKER: Role = "worker"
OPERATOR: Role = "operator"

OPERATOR_PATHS = frozenset({contract.PATH_EVICT, contract.PATH_STARTING, contract.PATH_DESIRED, contract.PATH_HANDOVER})
GROUP_PATHS = frozenset({contract.PATH_QUORUM, contract.PATH_HEARTBEAT, contract.PATH_WATCH})
PUBLIC_PATHS = frozenset({contract.PATH_HEALTH})


def bearer(authorization: str) -> bytes:
    """The token of an ``Authorization: Bearer <token>`` header value, b"" for none. Bytes a client sent outside UTF-8
    (aiohttp keeps them as surrogates) are kept as they came: they match no token, and must not fail the request."""
    if not authorization.startswith("Bearer "):
        return b""
    return authorization[7:].encode("utf-8", "surrogateescape")


class Credentials:
    """The lighthouse's two tokens; ``role`` says whose token a request carries (constant time for either)."""

    def __init__(self, worker_token: str, operator_token: str) -> None:
        if not worker_token:
            raise ValueError(f"the lighthouse needs the job's bearer token: set {contract.ENV_TOKEN} or --token-file")
        if not operator_token:
            raise ValueError(
                f"the lighthouse needs the operator's bearer token (the only one its membership API accepts): set "
                f"{contract.ENV_OPERATOR_TOKEN}, {contract.ENV_OPERATOR_TOKEN_FILE} or --operator-token-file"
            )
        if hmac.compare_digest(worker_token.encode(), operator_token.encode()):
            raise ValueError(
                "the operator's token must differ from the job's worker token: every worker holds that one"
            )
        self._worker = worker_token.encode()
        self._operator = operator_token.encode()

    def role(self, given: bytes) -> Role | None:
        """Whose token ``given`` is (the worker's checked first: nearly every request is a group's); None: nobody's."""
        if hmac.compare_digest(given, self._worker):
            return WORKER
        if hmac.compare_digest(given, self._operator):
            return OPERATOR
        return None


def refusal(role: Role, path: str) -> str | None:
    """Why a request of ``role`` may not call ``path`` (answered 403), or None when it may."""
    if role == WORKER and path in OPERATOR_PATHS:
        return (
            f"{path} is the operator's call: the job's worker token may not change the job's membership "
            "(it takes the operator's token)"
        )
    if role == OPERATOR and path in GROUP_PATHS:
        return (
            f"{path} is a replica group's call: the operator's token may not act as a group (it takes the job's token)"
        )
    return None
