"""Every malformed request to the job's two HTTP servers -- a real lighthouse process and a real recovery server, on
loopback -- is answered with the contract's JSON error (ErrorResponse) and a 4xx status: never a dropped connection,
an HTML or text page, or a 500; it changes nothing, and the server serves a good request right after it.

Requests go over raw sockets, byte for byte as listed (a garbled request line, non-UTF-8 header bytes, a declared
length with no body), and the answer is read with http.client: no answer at all, or one that is not HTTP, fails."""

from __future__ import annotations

import http.client
import json
import socket
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
from ftjob import contract
from ftjob.contract.lighthouse_api import ErrorResponse, StatusResponse
from ftjob.ft.recovery.transport import RecoveryServer

from tests.support.local_job import OPERATOR_TOKEN, TOKEN, Lighthouse

RECOVERY_TOKEN = "recovery-token"
STEP = 5  # the recovery server's published snapshot
ABSENT = object()  # a header left out


@dataclass(frozen=True)
class Case:
    """One malformed request and the status it must get."""

    name: str
    raw: bytes
    status: int


def request(
    method: str,
    path: str,
    token: str | bytes | None,
    body: bytes | None = None,
    content_type: object = "application/json",
    extra: tuple[bytes, ...] = (),
    version: str = "HTTP/1.1",
) -> bytes:
    """The raw bytes of one request; ``token`` None sends no Authorization header; the Content-Length follows the body
    unless ``extra`` declares its own."""
    head = [f"{method} {path} {version}".encode(), b"Host: 127.0.0.1", b"Connection: close"]
    if token is not None:
        head.append(b"Authorization: Bearer " + (token if isinstance(token, bytes) else token.encode()))
    if body is not None and content_type is not ABSENT:
        head.append(f"Content-Type: {content_type}".encode())
    if body is not None and not any(h.lower().startswith((b"content-length:", b"transfer-encoding:")) for h in extra):
        head.append(f"Content-Length: {len(body)}".encode())
    head += extra
    return b"\r\n".join(head) + b"\r\n\r\n" + (body or b"")


def exchange(port: int, raw: bytes, timeout: float = 30.0) -> tuple[int, str, bytes]:
    """Sends ``raw`` on a new connection and reads one answer: (status, Content-Type, body). A connection closed with
    no answer raises (http.client.RemoteDisconnected), as does an answer without an HTTP status line."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        try:
            sock.sendall(raw)
        except OSError:  # the server may answer and stop reading before all of a large body went out
            pass
        resp = http.client.HTTPResponse(sock)
        resp.begin()
        return resp.status, resp.getheader("Content-Type", ""), resp.read()


def assert_json_error(case: Case, status: int, kind: str, body: bytes) -> ErrorResponse:
    assert kind.split(";")[0] == "application/json", (case.name, status, kind, body[:300])
    error = ErrorResponse.model_validate_json(body)  # the contract's error body, not a page
    assert error.error, (case.name, body)
    assert status == case.status, (case.name, status, error.error)
    return error


# --- the lighthouse ------------------------------------------------------------------------------------------------
W, OP = TOKEN, OPERATOR_TOKEN  # the job's (worker) token, the operator's
HB = contract.PATH_HEARTBEAT
GOOD_BEAT = json.dumps({"group": "0", "incarnation": "i", "step": 0}).encode()
WATCH = contract.PATH_WATCH
UPGRADE = (b"Connection: Upgrade", b"Upgrade: websocket", b"Sec-WebSocket-Version: 13",
           b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==")  # fmt: skip
NESTED = b'{"group": ' + b"[" * 20_000 + b"]" * 20_000 + b', "incarnation": "i", "step": 0}'

LIGHTHOUSE_CASES = [
    # query strings
    Case("query on a path that takes none", request("GET", contract.PATH_STATUS + "?verbose=1", W), 400),
    Case("query on a POST", request("POST", contract.PATH_QUORUM + "?timeout=5", W, GOOD_BEAT), 400),
    Case("watch: group not an integer", request("GET", f"{WATCH}?group=abc&incarnation=i", W, extra=UPGRADE), 400),
    Case("watch: negative rank", request("GET", f"{WATCH}?group=0&incarnation=i&rank=-1", W, extra=UPGRADE), 400),
    Case("watch: huge rank", request("GET", f"{WATCH}?group=0&incarnation=i&rank={'9' * 40}", W, extra=UPGRADE), 400),
    Case("watch: huge group", request("GET", f"{WATCH}?group={'9' * 40}&incarnation=i", W, extra=UPGRADE), 400),
    Case("watch: repeated key", request("GET", f"{WATCH}?group=0&group=1&incarnation=i", W, extra=UPGRADE), 400),
    Case("watch: unknown key", request("GET", f"{WATCH}?group=0&incarnation=i&x=1", W, extra=UPGRADE), 400),
    Case("watch: missing key", request("GET", f"{WATCH}?group=0", W, extra=UPGRADE), 400),
    Case("watch: no upgrade handshake", request("GET", f"{WATCH}?group=0&incarnation=i", W), 400),
    Case("watch: undeclared group", request("GET", f"{WATCH}?group=50&incarnation=i", W, extra=UPGRADE), 403),
    # headers
    Case("no Authorization", request("GET", contract.PATH_STATUS, None), 401),
    Case("Bearer without a token", request("GET", contract.PATH_STATUS, b""), 401),
    Case("not a bearer token", request("GET", contract.PATH_STATUS, None, extra=(b"Authorization: Basic eDp5",)), 401),
    Case("token bytes outside UTF-8", request("GET", contract.PATH_STATUS, b"\xff\xfe\x80"), 401),
    Case(
        "control bytes in a header",
        request("GET", contract.PATH_STATUS, None, extra=(b"Authorization: \x01\x02",)),
        400,
    ),
    Case("wrong Content-Type", request("POST", HB, W, GOOD_BEAT, content_type="text/plain"), 415),
    Case("form Content-Type", request("POST", HB, W, GOOD_BEAT, content_type="application/x-www-form-urlencoded"), 415),
    Case("no Content-Type", request("POST", HB, W, GOOD_BEAT, content_type=ABSENT), 415),
    Case("huge Content-Length, no body", request("POST", HB, W, b"", extra=(b"Content-Length: 999999999999",)), 413),
    Case("Content-Length not a number", request("POST", HB, W, b"{}", extra=(b"Content-Length: abc",)), 400),
    Case("two Content-Lengths", request("POST", HB, W, b"{}", extra=(b"Content-Length: 2", b"Content-Length: 3")), 400),
    Case("header without a colon", request("GET", contract.PATH_STATUS, W, extra=(b"NoColonHere",)), 400),
    Case("header line too long", request("GET", contract.PATH_STATUS, W, extra=(b"X-Big: " + b"a" * 20_000,)), 400),
    Case("garbled request line", b"GARBAGE\r\n\r\n", 400),
    Case("TLS bytes on the plain port", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64, 400),
    Case("unknown HTTP version", request("GET", contract.PATH_STATUS, W, version="HTTP/9.9"), 400),
    # bodies
    Case("body not JSON", request("POST", HB, W, b"{not json"), 400),
    Case("body not UTF-8", request("POST", HB, W, b"\xff\xfe\x00{"), 400),
    Case("body JSON of the wrong type", request("POST", HB, W, b"[1, 2]"), 400),
    Case(
        "field of the wrong type",
        request("POST", HB, W, json.dumps({"group": "0", "incarnation": "i", "step": "1"}).encode()),
        400,
    ),
    Case("missing fields", request("POST", HB, W, b'{"group": "0"}'), 400),
    Case(
        "extra field",
        request("POST", HB, W, json.dumps({"group": "0", "incarnation": "i", "step": 0, "x": 1}).encode()),
        400,
    ),
    Case(
        "negative step",
        request("POST", HB, W, json.dumps({"group": "0", "incarnation": "i", "step": -1}).encode()),
        400,
    ),
    Case(
        "huge step",
        request("POST", HB, W, json.dumps({"group": "0", "incarnation": "i", "step": 10**40}).encode()),
        400,
    ),
    Case("deeply nested", request("POST", HB, W, NESTED), 400),
    Case("empty body", request("POST", contract.PATH_QUORUM, W, b""), 400),
    Case(
        "body too large (chunked)",
        request("POST", HB, W, b"410000\r\n" + b" " * 0x410000 + b"\r\n", extra=(b"Transfer-Encoding: chunked",)),
        413,
    ),
    Case("membership body of the wrong type", request("POST", contract.PATH_EVICT, OP, b'{"groups": "0"}'), 400),
    Case(
        "desired: groups below replicas",
        request("POST", contract.PATH_DESIRED, OP, b'{"replicas": 3, "groups": 2}'),
        400,
    ),
    # paths and methods
    Case("unknown path", request("GET", "/v1/nope", W), 404),
    Case("unknown path, percent garbage", request("GET", "/v1/%zz%00", W), 404),
    Case("unknown path, no token", request("GET", "/v1/nope", None), 401),
    Case("GET of a POST path", request("GET", contract.PATH_QUORUM, W), 405),
    Case("DELETE of status", request("DELETE", contract.PATH_STATUS, W), 405),
    Case("PUT of a membership path", request("PUT", contract.PATH_EVICT, OP, b"{}"), 405),
    Case("POST of status", request("POST", contract.PATH_STATUS, W, b"{}"), 405),
    Case("unknown method", request("FROB", contract.PATH_STATUS, W), 400),
    # the other role's token
    Case(
        "worker token on the membership API",
        request("POST", contract.PATH_DESIRED, W, b'{"replicas": 1, "groups": 100}'),
        403,
    ),
    Case("operator token on a group call", request("POST", HB, OP, GOOD_BEAT), 403),
]


@pytest.fixture(scope="module")
def lighthouse(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lighthouse]:
    tmp = tmp_path_factory.mktemp("malformed-lighthouse")
    lh = Lighthouse(tmp, "--min-replicas", "1", "--groups", "3", "--heartbeat-timeout", "60").start()
    yield lh
    lh.kill()


@pytest.mark.parametrize("case", LIGHTHOUSE_CASES, ids=lambda c: c.name)
def test_the_lighthouse_answers_every_malformed_request_with_the_contracts_json(lighthouse: Lighthouse, case: Case):
    status, kind, body = exchange(lighthouse.port, case.raw)
    assert_json_error(case, status, kind, body)
    good = request("GET", contract.PATH_STATUS, W)
    status, kind, body = exchange(lighthouse.port, good)  # on a new connection: the server serves on
    assert status == 200, (case.name, status, body[:300])
    after = StatusResponse.model_validate_json(body)
    assert after.members == [] and after.starting == [] and after.history == [], (case.name, after)  # nothing kept
    assert after.desired_replicas is None, case.name


# --- the recovery server -------------------------------------------------------------------------------------------
R = RECOVERY_TOKEN
MANIFEST = f"{contract.PATH_RECOVERY}/{STEP}/manifest"

RECOVERY_CASES = [
    # query strings
    Case("wait not a number", request("GET", MANIFEST + "?wait=abc", R), 400),
    Case("wait negative", request("GET", MANIFEST + "?wait=-1", R), 400),
    Case("wait infinite", request("GET", MANIFEST + "?wait=1e999", R), 400),
    Case("wait NaN", request("GET", MANIFEST + "?wait=nan", R), 400),
    Case("wait empty", request("GET", MANIFEST + "?wait=", R), 400),
    Case("wait without a value", request("GET", MANIFEST + "?wait", R), 400),
    Case("wait repeated", request("GET", MANIFEST + "?wait=1&wait=2", R), 400),
    Case("unknown key", request("GET", MANIFEST + "?timeout=1", R), 400),
    Case("garbled query", request("GET", MANIFEST + "?&&=&", R), 400),
    # headers
    Case("no Authorization", request("GET", MANIFEST, None), 401),
    Case("Bearer without a token", request("GET", MANIFEST, b""), 401),
    Case("not a bearer token", request("GET", MANIFEST, None, extra=(b"Authorization: Basic eDp5",)), 401),
    Case("token bytes outside UTF-8", request("GET", MANIFEST, b"\xff\xfe\x80"), 401),
    Case("wrong token", request("GET", MANIFEST, "not-the-token"), 401),
    Case("huge Content-Length on a GET", request("GET", MANIFEST, R, extra=(b"Content-Length: 999999999999",)), 413),
    Case("Content-Length not a number", request("GET", MANIFEST, R, extra=(b"Content-Length: abc",)), 400),
    Case("chunked body on a GET", request("GET", MANIFEST, R, extra=(b"Transfer-Encoding: chunked",)), 413),
    Case("header line too long", request("GET", MANIFEST, R, extra=(b"X-Big: " + b"a" * 70_000,)), 431),
    Case("garbled request line", b"GARBAGE\r\n\r\n", 400),
    Case("four words in the request line", b"GET / HTTP/1.1 extra\r\n\r\n", 400),
    Case("bad HTTP version", request("GET", MANIFEST, R, version="HTTX/1.1"), 400),
    Case("unsupported HTTP version", request("GET", MANIFEST, R, version="HTTP/9.9"), 400),
    Case("HTTP/0.9 request", f"GET {MANIFEST}\r\n\r\n".encode(), 400),
    # paths
    Case("unknown path", request("GET", "/v1/nope", R), 404),
    Case("step not a number", request("GET", f"{contract.PATH_RECOVERY}/abc/manifest", R), 404),
    Case("step a non-ASCII digit", request("GET", f"{contract.PATH_RECOVERY}/²/manifest", R), 404),
    Case("huge step", request("GET", f"{contract.PATH_RECOVERY}/{'9' * 40}/manifest", R), 404),
    Case("unknown leaf", request("GET", f"{contract.PATH_RECOVERY}/{STEP}/other", R), 404),
    Case("chunk without an index", request("GET", f"{contract.PATH_RECOVERY}/{STEP}/chunk", R), 404),
    Case("chunk index not a number", request("GET", f"{contract.PATH_RECOVERY}/{STEP}/chunk/x", R), 404),
    Case("chunk past the end", request("GET", f"{contract.PATH_RECOVERY}/{STEP}/chunk/999999", R), 404),
    Case("a step not published", request("GET", f"{contract.PATH_RECOVERY}/{STEP + 1}/manifest", R), 404),
    Case("a step moved past", request("GET", f"{contract.PATH_RECOVERY}/{STEP - 1}/manifest", R), 410),
    # methods
    Case("POST", request("POST", MANIFEST, R, b"{}"), 405),
    Case("DELETE", request("DELETE", MANIFEST, R), 405),
    Case("unknown method", request("FROB", MANIFEST, R), 405),
]


@pytest.fixture(scope="module")
def recovery() -> Iterator[RecoveryServer]:
    server = RecoveryServer(RECOVERY_TOKEN, "127.0.0.1", 0, chunk_bytes=4096)
    server.publish(STEP, {"w": torch.arange(3000, dtype=torch.float32)})
    yield server
    server.close()


def recovery_port(server: RecoveryServer) -> int:
    return int(server.address.rpartition(":")[2])


@pytest.mark.parametrize("case", RECOVERY_CASES, ids=lambda c: c.name)
def test_the_recovery_server_answers_every_malformed_request_with_the_contracts_json(
    recovery: RecoveryServer, case: Case
):
    port = recovery_port(recovery)
    status, kind, body = exchange(port, case.raw)
    assert_json_error(case, status, kind, body)
    status, kind, body = exchange(port, request("GET", MANIFEST, R))  # on a new connection: it serves on
    assert status == 200 and kind == "application/json" and json.loads(body)["step"] == STEP, (case.name, status)


def test_a_refusal_on_a_kept_alive_connection_leaves_it_usable_or_closes_it(recovery: RecoveryServer):
    """http.server keeps connections alive: a refused request that left no unread bytes is followed by a good one on
    the same connection; one whose body was never read closes the connection instead of parsing the body as a
    request."""
    conn = http.client.HTTPConnection("127.0.0.1", recovery_port(recovery), timeout=30)
    try:
        for path, status in ((MANIFEST + "?wait=abc", 400), ("/v1/nope", 404), (MANIFEST, 200)):
            conn.request("GET", path, headers={"Authorization": f"Bearer {R}"})
            resp = conn.getresponse()
            body = resp.read()
            assert resp.status == status, (path, body)
            assert resp.getheader("Connection") != "close", path
        conn.request("GET", MANIFEST, body=b"hello", headers={"Authorization": f"Bearer {R}"})
        resp = conn.getresponse()
        assert resp.status == 413 and resp.getheader("Connection") == "close"
        ErrorResponse.model_validate_json(resp.read())
    finally:
        conn.close()
