"""Live recovery transport: a per-rank HTTP server that serves a snapshot of this rank's state, and the fetcher a
healing rank uses to copy it.

Serving never stalls training: ``publish`` makes one copy at the step boundary (recovery_codec.pack) and the server
threads hash and send that copy while the training thread goes on. The wire carries JSON metadata and raw bytes only
(never pickle), split into chunks that are CRC-checked on arrival, fetched in parallel over keep-alive
connections, and fetched again when a checksum does not match. With a TlsConfig (the job's FTJOB_TLS_* files) the
server speaks only TLS and the fetcher verifies the peer's certificate against the job's CA and the job's worker
name (ftjob.contract.tls); without one both speak plain HTTP (local development).
"""

from __future__ import annotations

import hmac
import http.client
import logging
import socket
import ssl
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch
from ftjob import contract
from ftjob.contract.lighthouse_api import ErrorResponse
from ftjob.contract.recovery_api import Chunk, RecoveryManifest
from ftjob.contract.tls import NamedHTTPSConnection, TlsConfig
from ftjob.ft.process_group import split_address
from ftjob.ft.recovery_codec import Packed, pack, unpack
from pydantic import ValidationError

log = logging.getLogger("ftjob.recovery")
CHUNK_BYTES = 4 * 1024 * 1024
HANDSHAKE_TIMEOUT_S = 10.0


class RecoveryError(RuntimeError):
    """The peer's state could not be fetched intact; nothing was applied."""


@dataclass
class _Snapshot:
    step: int
    packed: Packed
    chunk_bytes: int
    manifest: bytes | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def manifest_bytes(self, hashers: ThreadPoolExecutor) -> bytes:
        with self.lock:  # first request hashes (in parallel); later ones reuse it
            if self.manifest is None:
                if self.packed.copied is not None:
                    self.packed.copied.synchronize()
                total = self.packed.buffer.numel()
                view = memoryview(self.packed.buffer.numpy()) if total else memoryview(b"")
                spans = [(o, min(self.chunk_bytes, total - o)) for o in range(0, total, self.chunk_bytes)]
                digests = list(hashers.map(lambda s: zlib.crc32(view[s[0] : s[0] + s[1]]), spans))
                manifest = RecoveryManifest(
                    step=self.step,
                    total_bytes=total,
                    chunks=[Chunk(offset=o, length=n, crc32=d) for (o, n), d in zip(spans, digests, strict=True)],
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
        self._token = token.encode()
        self._chunk_bytes = chunk_bytes
        self._snap: _Snapshot | None = None
        self._cond = threading.Condition()
        self._hashers = ThreadPoolExecutor(4, thread_name_prefix="recovery-hash")
        self.corrupt_chunks: dict[int, int] = {}  # fault injection (tests, benches): chunk index -> times to corrupt
        self.chunks_served = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # quiet: one line per chunk is noise
                pass

            def do_GET(self) -> None:
                server._handle(self)

        self._http = _HTTPServer(("0.0.0.0", port), Handler, tls.server_context if tls else None)
        self.address = f"{advertise_addr}:{self._http.server_address[1]}"
        self._thread = threading.Thread(target=self._http.serve_forever, name="recovery-server", daemon=True)
        self._thread.start()

    def publish(self, step: int, state: dict[str, Any]) -> None:
        """Snapshots ``state`` (one copy, on the caller's thread at a step boundary) and serves it from now on."""
        snap = _Snapshot(step, pack(state), self._chunk_bytes)
        with self._cond:
            self._snap = snap
            self._cond.notify_all()

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()
        self._hashers.shutdown(wait=False)

    def _reply(
        self, h: BaseHTTPRequestHandler, status: int, body: bytes | memoryview, kind: str = "application/json"
    ) -> None:
        h.send_response(status)
        h.send_header("Content-Type", kind)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
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
        header = h.headers.get("Authorization", "")
        given = header[7:].encode() if header.startswith("Bearer ") else b""
        if not hmac.compare_digest(given, self._token):
            return self._error(h, 401, "missing or wrong bearer token: use the job's token")
        path, _, query = h.path.partition("?")
        parts = path.removeprefix(contract.PATH_RECOVERY).strip("/").split("/")
        if not path.startswith(contract.PATH_RECOVERY) or not parts[0].isdigit() or len(parts) not in (2, 3):
            return self._error(h, 404, f"unknown path {path}: use {contract.PATH_RECOVERY}/STEP/manifest|chunk/N")
        wait_s = float(query.removeprefix("wait=")) if query.startswith("wait=") else 0.0
        snap = self._snapshot_for(int(parts[0]), min(wait_s, 120.0))
        if isinstance(snap, str):
            return self._error(h, 404 if "within" in snap else 410, snap)
        if parts[1:] == ["manifest"]:
            return self._reply(h, 200, snap.manifest_bytes(self._hashers))
        if len(parts) != 3 or parts[1] != "chunk" or not parts[2].isdigit():
            return self._error(h, 404, f"unknown path {path}")
        index, total = int(parts[2]), snap.packed.buffer.numel()
        offset = index * snap.chunk_bytes
        if offset >= total:
            return self._error(h, 404, f"chunk {index} is past the end of the snapshot ({total} bytes)")
        end = min(offset + snap.chunk_bytes, total)
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
    bytes: int = 0
    seconds: float = 0.0
    chunks: int = 0
    retries: int = 0


class _Fetcher:
    def __init__(self, address: str, token: str, timeout_s: float, tls: TlsConfig | None) -> None:
        self.host, self.port = split_address(address)
        self.headers = {"Authorization": f"Bearer {token}"}
        self.timeout_s = timeout_s
        self.tls = tls
        self.local = threading.local()

    def _connect(self) -> http.client.HTTPConnection:
        if self.tls is None:
            return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
        # by pod IP: the certificate must carry the job's worker name and be signed by the job's CA
        return NamedHTTPSConnection(self.host, self.port, context=self.tls.client_context,
                                    server_name=self.tls.worker_name, timeout=self.timeout_s)  # fmt: skip

    def get(self, path: str, into: memoryview | None = None) -> bytes | int:
        """GET ``path``; streams the body into ``into`` when given (returns its length), else returns the body."""
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
            length = int(resp.getheader("Content-Length", "-1"))
            if length != len(into):
                resp.read()
                raise RecoveryError(f"peer sent {length} bytes for {path}, expected {len(into)}")
            got = 0
            while got < length:
                n = resp.readinto(into[got:])
                if not n:
                    raise RecoveryError(f"peer closed the connection after {got} of {length} bytes of {path}")
                got += n
            return got
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
) -> tuple[Any, FetchStats]:
    """Copies the snapshot of ``step`` from the recovery server at ``address`` (over TLS, verified, with ``tls``);
    raises RecoveryError if any chunk stays corrupt after ``max_attempts``, the peer is gone or is not the job's.
    Returns (state, stats)."""
    start = time.monotonic()
    fetcher = _Fetcher(address, token, timeout_s + 10.0, tls)  # the socket outlives the server's own wait
    base = f"{contract.PATH_RECOVERY}/{step}"
    try:
        manifest = RecoveryManifest.model_validate_json(fetcher.get(f"{base}/manifest?wait={timeout_s}"))
    except ValidationError as e:
        raise RecoveryError(f"malformed recovery manifest from {address}: {e}") from e
    chunks, total = manifest.chunks, manifest.total_bytes
    cuda = device.startswith("cuda")
    staging = torch.empty(total, dtype=torch.uint8, pin_memory=cuda and torch.cuda.is_available())
    view = memoryview(staging.numpy()) if total else memoryview(bytearray())
    stats = FetchStats(bytes=total, chunks=len(chunks))
    lock = threading.Lock()

    def one(index: int) -> None:
        chunk = chunks[index]
        dst = view[chunk.offset : chunk.offset + chunk.length]
        for attempt in range(1, max_attempts + 1):
            try:
                fetcher.get(f"{base}/chunk/{index}", into=dst)
            except RecoveryError:
                if attempt == max_attempts:
                    raise
            else:
                if zlib.crc32(dst) == chunk.crc32:  # zlib drops the GIL: the fetch threads check in parallel
                    return
                if attempt == max_attempts:
                    raise RecoveryError(f"chunk {index} from {address} failed its checksum {max_attempts} times")
            with lock:
                stats.retries += 1
            log.warning("recovery chunk %d from %s was bad (attempt %d); fetching it again", index, address, attempt)

    with ThreadPoolExecutor(max(1, min(parallel, len(chunks))), thread_name_prefix="recovery-fetch") as pool:
        list(pool.map(one, range(len(chunks))))
    buffer = staging.to(device, non_blocking=True) if cuda else staging
    if cuda:
        torch.cuda.current_stream().synchronize()
    state = unpack(manifest.state, manifest.tensors, buffer, template)
    stats.seconds = time.monotonic() - start
    return state, stats
