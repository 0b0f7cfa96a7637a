"""Live recovery transport: a per-rank HTTP server that serves a snapshot of this rank's state, and the fetcher a
healing rank uses to copy it.

Serving never stalls training: ``publish`` makes one copy at the step boundary (recovery_codec.pack); a background
thread checksums it and the server threads send it, straight from that copy, while the training thread goes on. The
wire carries JSON metadata and raw bytes only (never pickle), split into chunks fetched in parallel over keep-alive
connections, received straight into their final place (the receiver's own tensors when they match, else one staging
buffer: no copy in between), checksummed there and fetched again when a checksum does not match. With a TlsConfig
(the job's FTJOB_TLS_* files) the server speaks only TLS and the fetcher verifies the peer's certificate against the
job's CA and the job's worker name (ftjob.contract.tls); without one both speak plain HTTP (local development).

Every refusal is the contract's ErrorResponse (JSON), whatever is wrong: 400 a malformed query (only ``wait=SECONDS``,
once, finite and >= 0) or request line or header, 401 no or a wrong token, 404 an unknown path or step, 405 a method
other than GET, 410 a step this rank moved past, 413 a request with a body; a bug answers 500 JSON too, and no request
is answered by dropping the connection.
"""

from __future__ import annotations

import hmac
import http.client
import logging
import math
import os
import re
import socket
import ssl
import threading
import time
import urllib.parse
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
import torch
from ftjob import contract
from ftjob.contract.lighthouse_api import ErrorResponse
from ftjob.contract.recovery_api import Chunk, RecoveryManifest
from ftjob.contract.tls import NamedHTTPSConnection, TlsConfig
from ftjob.ft.allreduce.process_group import split_address
from ftjob.ft.recovery.codec import (
    ALIGN,
    Packed,
    check_layout,
    chunk_pieces,
    chunk_sums,
    host_buffer,
    pack,
    segments,
    targets,
    to_device,
    unpack,
)
from pydantic import ValidationError

log = logging.getLogger("ftjob.recovery")
CHUNK_BYTES = 16 * 1024 * 1024  # large: fewer requests, and HTTP parsing holds the GIL (smaller chunks fetch slower)
MASK = 2**64 - 1
PAGE = 4096
# Each connection's receive window. Autotuned ones grow to 32 MiB (tcp_rmem): 4 streams then put ~2,000 64 KiB
# packets in flight, loopback's backlog (netdev_max_backlog 1000) drops some, and a 200 ms retransmit timeout stalls
# the copy for several times its length. 4 MiB x the streams still covers a datacenter link's bandwidth x delay.
RCVBUF_BYTES = 4 * 1024 * 1024
HANDSHAKE_TIMEOUT_S = 10.0
MAX_WAIT_S = 120.0  # the longest a request waits for its step's snapshot (?wait= is capped to it)
# GET {PATH_RECOVERY}/{step}/manifest or .../{step}/chunk/{i}: ASCII digits only (str.isdigit also takes "²", which
# int() refuses), at most 19 of them (below 2**63)
_PATH = re.compile(re.escape(contract.PATH_RECOVERY) + r"/([0-9]{1,19})/(?:(manifest)|chunk/([0-9]{1,19}))")


class RecoveryError(RuntimeError):
    """The peer's state could not be fetched intact; nothing was returned (but see fetch_state's ``in_place``)."""


class _Refused(Exception):
    """A request the server refuses: answered ``status`` with the contract's error."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _wait_s(query: str) -> float:
    """The query's ``wait=SECONDS`` (0 without a query), capped at MAX_WAIT_S; _Refused 400 for anything else."""
    if not query:
        return 0.0
    try:
        fields = urllib.parse.parse_qs(query, keep_blank_values=True, strict_parsing=True, max_num_fields=4)
    except ValueError as e:
        raise _Refused(400, f"malformed query {query[:100]!r} ({e}): use ?wait=SECONDS") from None
    if set(fields) != {"wait"}:
        unknown = sorted(set(fields) - {"wait"})
        raise _Refused(400, f"unknown query parameter(s) {unknown}: the only one is wait=SECONDS")
    if len(fields["wait"]) != 1:
        raise _Refused(400, "wait given more than once")
    text = fields["wait"][0]
    try:
        wait = float(text)
    except ValueError:
        wait = math.nan
    if not math.isfinite(wait) or wait < 0:
        raise _Refused(400, f"wait must be a finite number of seconds >= 0, got {text[:40]!r}")
    return min(wait, MAX_WAIT_S)


def _checksums(packed: Packed, chunk_bytes: int) -> list[Chunk]:
    if packed.copied is not None:
        packed.copied.synchronize()
    total = packed.buffer.numel()
    flat = packed.buffer.numpy()
    chunks = []
    for offset in range(0, total, chunk_bytes):
        length = min(chunk_bytes, total - offset)
        a, b = chunk_sums(flat[offset : offset + length])
        chunks.append(Chunk(offset=offset, length=length, sum64=a, block_sum64=b))
    return chunks


@dataclass
class _Snapshot:
    step: int
    packed: Packed
    chunks: Future[list[Chunk]]  # checksummed in the background from publish on (fast: numpy word sums)
    manifest: bytes | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def manifest_bytes(self) -> bytes:
        with self.lock:
            if self.manifest is None:
                manifest = RecoveryManifest(
                    step=self.step,
                    total_bytes=self.packed.buffer.numel(),
                    chunks=self.chunks.result(),
                    tensors=self.packed.tensors,
                    state=self.packed.state,
                )
                self.manifest = manifest.model_dump_json().encode()
            return self.manifest


class _HTTPServer(ThreadingHTTPServer):
    """With a TLS context, every connection's handshake runs on its own handler thread, never on the accept loop (a
    client that connects and stays silent must not stall the others); a failed handshake just closes it: a
    plain-HTTP request gets no answer."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], tls: ssl.SSLContext | None):
        self.tls = tls
        super().__init__(address, handler)

    def finish_request(self, request: Any, client_address: Any) -> None:
        if self.tls is None:
            return super().finish_request(request, client_address)
        request.settimeout(HANDSHAKE_TIMEOUT_S)
        try:
            conn = self.tls.wrap_socket(request, server_side=True)  # takes over the socket (closed on failure)
        except (ssl.SSLError, OSError) as e:
            log.debug("recovery: TLS handshake with %s failed: %s", client_address, e)
            return
        try:
            conn.settimeout(None)
            super().finish_request(conn, client_address)
        finally:
            try:
                conn.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            conn.close()


class RecoveryServer:
    """Serves this rank's latest published snapshot: GET {PATH_RECOVERY}/{step}/manifest and .../chunk/{i}; over TLS
    only when ``tls`` is given."""

    def __init__(
        self,
        token: str,
        advertise_addr: str,
        port: int = 0,
        chunk_bytes: int = CHUNK_BYTES,
        tls: TlsConfig | None = None,
    ) -> None:
        if chunk_bytes <= 0 or chunk_bytes % ALIGN:
            raise ValueError(f"chunk_bytes must be a positive multiple of {ALIGN}, not {chunk_bytes}")
        self._token = token.encode()
        self._chunk_bytes = chunk_bytes
        self._snap: _Snapshot | None = None
        self._cond = threading.Condition()
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="recovery-checksum")
        self.corrupt_chunks: dict[int, int] = {}  # fault injection (tests, benches): chunk index -> times to corrupt
        self.chunks_served = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # quiet: one line per chunk is noise
                pass

            def do_GET(self) -> None:
                server._handle(self)

            # every other method is refused with the contract's 405, not http.server's HTML 501 page
            do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = do_OPTIONS = do_TRACE = do_CONNECT = do_GET

            def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
                """http.server's own refusals (a request line or header it cannot parse, an unknown method): the
                contract's JSON error instead of its HTML page; the connection closes after it."""
                if code == HTTPStatus.NOT_IMPLEMENTED:  # a method it has no do_ for
                    code, message = HTTPStatus.METHOD_NOT_ALLOWED, f"method {self.command!r} not allowed: use GET"
                elif code == HTTPStatus.HTTP_VERSION_NOT_SUPPORTED:  # the client's request is at fault: a 4xx
                    code, message = HTTPStatus.BAD_REQUEST, f"{message}: use HTTP/1.1"
                if getattr(self, "request_version", "HTTP/0.9") == "HTTP/0.9":
                    self.request_version = "HTTP/1.0"  # else http.server would send the body with no status line
                self.close_connection = True
                server._error(self, code, f"malformed request: {message or HTTPStatus(code).phrase}")

        self._http = _HTTPServer(("0.0.0.0", port), Handler, tls.server_context if tls else None)
        self.address = f"{advertise_addr}:{self._http.server_address[1]}"
        self._thread = threading.Thread(target=self._http.serve_forever, name="recovery-server", daemon=True)
        self._thread.start()

    def publish(self, step: int, state: dict[str, Any]) -> None:
        """Snapshots ``state`` (one copy, on the caller's thread at a step boundary) and serves it from now on."""
        packed = pack(state)
        snap = _Snapshot(step, packed, self._hasher.submit(_checksums, packed, self._chunk_bytes))
        with self._cond:
            self._snap = snap
            self._cond.notify_all()

    def close(self) -> None:
        """Stops serving and closes the listening socket; the checksum pool is shut down without waiting for it."""
        self._http.shutdown()
        self._http.server_close()
        self._hasher.shutdown(wait=False)

    def _reply(
        self, h: BaseHTTPRequestHandler, status: int, body: bytes | memoryview, kind: str = "application/json"
    ) -> None:
        h.send_response(status)
        h.send_header("Content-Type", kind)
        h.send_header("Content-Length", str(len(body)))
        if status == HTTPStatus.METHOD_NOT_ALLOWED:
            h.send_header("Allow", "GET")
        if h.close_connection:
            h.send_header("Connection", "close")
        h.end_headers()
        if h.command != "HEAD":  # a HEAD answer has no body, whatever its Content-Length says
            h.wfile.write(body)

    def _error(self, h: BaseHTTPRequestHandler, status: int, message: str) -> None:
        self._reply(h, status, ErrorResponse(error=message).model_dump_json().encode())

    def _snapshot_for(self, step: int, wait_s: float) -> _Snapshot | str:
        deadline = time.monotonic() + wait_s
        with self._cond:
            while self._snap is None or self._snap.step < step:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return f"no snapshot of step {step} was published within {wait_s}s"
                self._cond.wait(remaining)
            if self._snap.step != step:
                return f"this rank has moved on to step {self._snap.step}; ask the lighthouse again"
            return self._snap

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        try:
            self._serve(h)
        except _Refused as e:
            self._error(h, e.status, str(e))
        except OSError:
            raise  # the client is gone (or its TLS broke): nothing can be told to it; http.server closes the socket
        except Exception:  # a bug: still the contract's answer, and the server goes on serving
            log.exception("recovery: %s %s failed", h.command, h.path[:200])
            h.close_connection = True
            self._error(h, 500, "internal error in the recovery server; see the trainer's log")

    def _serve(self, h: BaseHTTPRequestHandler) -> None:
        """One request: refusals raise _Refused, checked in this order before any wait (401, 405, 400/413, 404,
        400 query)."""
        length, chunked = h.headers.get("Content-Length"), "Transfer-Encoding" in h.headers
        if chunked or (length is not None and length.strip() != "0") or h.request_version == "HTTP/0.9":
            h.close_connection = True  # a body is never read: what follows it on the connection cannot be trusted
        if h.request_version == "HTTP/0.9":
            h.request_version = "HTTP/1.0"  # answered with a status line
            raise _Refused(400, "HTTP/0.9 is not served: use HTTP/1.1")
        header = h.headers.get("Authorization", "")
        given = header[7:].encode("utf-8", "surrogateescape") if header.startswith("Bearer ") else b""
        if not hmac.compare_digest(given, self._token):
            raise _Refused(401, "missing or wrong bearer token: use the job's token")
        if h.command != "GET":
            raise _Refused(405, f"method {h.command} not allowed: use GET")
        if chunked:
            raise _Refused(413, "a GET takes no body (Transfer-Encoding given)")
        if length is not None:
            if not length.strip().isascii() or not length.strip().isdigit():
                raise _Refused(400, f"Content-Length must be a number of bytes, got {length[:40]!r}")
            if length.strip().strip("0"):  # not int(): a number of thousands of digits is refused the same
                raise _Refused(413, f"a GET takes no body (Content-Length {length.strip()[:40]})")
        path, _, query = h.path.partition("?")
        match = _PATH.fullmatch(path)
        if match is None:
            raise _Refused(404, f"unknown path {path[:200]!r}: use {contract.PATH_RECOVERY}/STEP/manifest|chunk/N")
        wait_s = _wait_s(query)
        snap = self._snapshot_for(int(match[1]), wait_s)
        if isinstance(snap, str):
            raise _Refused(404 if "within" in snap else 410, snap)
        if match[2] == "manifest":
            return self._reply(h, 200, snap.manifest_bytes())
        index, total = int(match[3]), snap.packed.buffer.numel()
        offset = index * self._chunk_bytes
        if offset >= total:
            return self._error(h, 404, f"chunk {index} is past the end of the snapshot ({total} bytes)")
        end = min(offset + self._chunk_bytes, total)
        data: bytes | memoryview = memoryview(snap.packed.buffer.numpy())[offset:end]
        if self.corrupt_chunks.get(index, 0) > 0:
            self.corrupt_chunks[index] -= 1
            flipped = bytearray(data)
            flipped[len(flipped) // 2] ^= 0xFF
            data = bytes(flipped)
        self.chunks_served += 1
        self._reply(h, 200, data, "application/octet-stream")  # a view of the snapshot: no copy per request


@dataclass
class FetchStats:
    """What one fetch of a peer's state took: bytes, seconds, chunks and chunks fetched again."""

    bytes: int = 0
    seconds: float = 0.0
    chunks: int = 0
    retries: int = 0


def _bounded_window(address: tuple[str, int], timeout: Any = None, source_address: Any = None) -> socket.socket:
    """socket.create_connection, with a receive window of RCVBUF_BYTES set before the handshake."""
    error: OSError | None = None
    for family, kind, proto, _name, addr in socket.getaddrinfo(*address, type=socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF_BYTES)
            sock.settimeout(timeout)
            if source_address:
                sock.bind(source_address)
            sock.connect(addr)
            return sock
        except OSError as e:
            sock.close()
            error = e
    raise error or OSError(f"{address[0]} resolves to no address")


class _Fetcher:
    def __init__(self, address: str, token: str, timeout_s: float, tls: TlsConfig | None) -> None:
        self.host, self.port = split_address(address)
        self.headers = {"Authorization": f"Bearer {token}"}
        self.timeout_s = timeout_s
        self.tls = tls
        self.local = threading.local()

    def _connect(self) -> http.client.HTTPConnection:
        conn: http.client.HTTPConnection
        if self.tls is None:
            conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
        else:  # by pod IP: the certificate must carry the job's worker name and be signed by the job's CA
            conn = NamedHTTPSConnection(self.host, self.port, context=self.tls.client_context,
                                        server_name=self.tls.worker_name, timeout=self.timeout_s)  # fmt: skip
        # http.client's one seam for the socket before its handshake: overriding connect() instead would copy its
        # TCP_NODELAY, audit and tunnel steps (tests/trainer/test_private_hooks.py checks the seam is still there)
        conn._create_connection = _bounded_window  # type: ignore[attr-defined]
        return conn

    def get(self, path: str, into: list[np.ndarray] | None = None) -> bytes | int:
        """GET ``path``; streams the body into the pieces of ``into`` in turn when given (returns its length), else
        returns the body."""
        conn = getattr(self.local, "conn", None)
        if conn is None:
            conn = self.local.conn = self._connect()
        try:
            conn.request("GET", path, headers=self.headers)
            resp = conn.getresponse()
            if resp.status != 200:
                raw = resp.read()
                try:
                    why = ErrorResponse.model_validate_json(raw).error
                except ValidationError:
                    why = raw.decode(errors="replace")
                raise RecoveryError(f"peer {self.host}:{self.port} answered {resp.status} for {path}: {why}")
            if into is None:
                return resp.read()
            length, expected = int(resp.getheader("Content-Length", "-1")), sum(len(p) for p in into)
            if length != expected:
                resp.read()
                raise RecoveryError(f"peer sent {length} bytes for {path}, expected {expected}")
            for piece in into:
                view, got = memoryview(piece), 0
                while got < len(view):  # large reads bypass the response's buffer: socket -> destination
                    n = resp.readinto(view[got:])
                    if not n:
                        raise RecoveryError(f"peer closed the connection in the middle of {path}")
                    got += n
            return length
        except ssl.SSLCertVerificationError as e:
            conn.close()
            self.local.conn = None
            raise RecoveryError(
                f"peer {self.host}:{self.port} is not a recovery server of this job: its certificate failed "
                f"verification ({e.verify_message}; expected {self.tls.worker_name if self.tls else '?'} signed by "
                f"the CA in {(self.tls.ca_file if self.tls else None) or 'the system trust store'})"
            ) from e
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            self.local.conn = None
            raise RecoveryError(f"fetching {path} from {self.host}:{self.port} failed: {e}") from e


def fetch_state(
    address: str,
    step: int,
    token: str,
    template: Any = None,
    device: str = "cpu",
    parallel: int = 4,
    timeout_s: float = 60.0,
    max_attempts: int = 3,
    tls: TlsConfig | None = None,
    in_place: bool = True,
) -> tuple[Any, FetchStats]:
    """Copies the snapshot of ``step`` from the recovery server at ``address`` (over TLS, verified, with ``tls``);
    raises RecoveryError if any chunk stays corrupt after ``max_attempts``, the peer is gone or is not the job's.
    Returns (state, stats).

    ``template`` is the receiver's own state. On the CPU, with ``in_place``, each of its tensors that matches the
    peer's (place, dtype, shape) receives the bytes itself, and the state returned holds it: no staging copy, and
    loading the state into the model is free. If the fetch then fails, those tensors may hold part of the peer's state:
    do not train on them before a heal succeeds (a Manager whose heal failed stays behind and heals again). With a
    CUDA ``device`` everything lands in pinned memory first and goes to the GPU (into the template's tensors there)
    only once every chunk is verified."""
    start = time.monotonic()
    fetcher = _Fetcher(address, token, timeout_s + 10.0, tls)  # the socket outlives the server's own wait
    base = f"{contract.PATH_RECOVERY}/{step}"
    try:
        manifest = RecoveryManifest.model_validate_json(fetcher.get(f"{base}/manifest?wait={timeout_s}"))
    except ValidationError as e:
        raise RecoveryError(f"malformed recovery manifest from {address}: {e}") from e
    chunks, total, tensors = manifest.chunks, manifest.total_bytes, manifest.tensors
    check_layout(tensors, total)
    cuda = device.startswith("cuda")
    staging = host_buffer(total, pinned=cuda and torch.cuda.is_available())
    own = targets(manifest.state, tensors, template, "cuda" if cuda else "cpu") if in_place else [None] * len(tensors)
    into = [None] * len(tensors) if cuda else own  # to the GPU only once verified
    per_chunk = chunk_pieces(segments(tensors, staging, into), chunks, total)
    stats = FetchStats(bytes=total, chunks=len(chunks))
    lock = threading.Lock()

    def one(index: int) -> None:
        chunk, pieces = chunks[index], per_chunk[index]
        for _pos, data in pieces:  # fault fresh pages in first, not inside recv (it stalls the stream's ACKs)
            data[::PAGE] = 0
        for attempt in range(1, max_attempts + 1):
            try:
                fetcher.get(f"{base}/chunk/{index}", into=[data for _, data in pieces])
            except RecoveryError:
                if attempt == max_attempts:
                    raise
            else:
                sums = [chunk_sums(data, pos) for pos, data in pieces]  # where the bytes landed: no copy
                if (sum(a for a, _ in sums) & MASK, sum(b for _, b in sums) & MASK) == (chunk.sum64, chunk.block_sum64):
                    return
                if attempt == max_attempts:
                    raise RecoveryError(f"chunk {index} from {address} failed its checksum {max_attempts} times")
            with lock:
                stats.retries += 1
            log.warning("recovery chunk %d from %s was bad (attempt %d); fetching it again", index, address, attempt)

    # no more streams than CPUs: each stream's thread copies from its socket, more only contend for the GIL and
    # the cores and make the fetch slower
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    streams = max(1, min(parallel, len(chunks), cpus))
    with ThreadPoolExecutor(streams, thread_name_prefix="recovery-fetch") as pool:
        list(pool.map(one, range(len(chunks))))
    if cuda:
        into = to_device(tensors, staging, own, device)
    state = unpack(manifest.state, tensors, staging, template, into)
    stats.seconds = time.monotonic() - start
    return state, stats
