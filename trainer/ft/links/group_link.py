"""The link inside one replica group that spares the lighthouse a connection per rank: only rank 0 talks to the
lighthouse; the group's other ranks hear its abort signals, and report their progress, through rank 0.

    rank 0 (LinkServer)                        rank r > 0 (LinkClient)
      listens on a TCP port     <-- connect --   hello: rank, the job token
      the current abort_below   -- 8 bytes -->   (connect returns: the link is up)
      every abort_below heard   -- 8 bytes -->   reader thread: sets abort_below, calls on_abort (wakes the step)
      the group's progress      <-- 9 bytes --   the rank's progress counter and waiting flag, whenever they change

Latency: rank 0's lighthouse client thread writes the 8 bytes the moment it hears an abort (before waking its own
collective), with TCP_NODELAY and a blocking reader on the other side: one network hop, no polling.

Failure: a link that drops without its goodbye frame means a dead process. Rank 0 then calls ``on_lost`` (the
Manager closes its lighthouse watch for good, which the lighthouse takes as the group disconnecting, and fails the
step) and closes every other link, so each rank > 0 sees its link drop too, calls ``on_lost`` and fails its step;
the operator replaces the whole group anyway.

Security: plain TCP, not TLS even when the job has a TlsConfig: the link only joins the processes of one replica
group (its pod set; the address travels over the group's own process group), carries counters and no state, and the
first message of every connection is the job's bearer token, compared in constant time: a connection without it is
closed unheard.
"""

from __future__ import annotations

import hmac
import logging
import selectors
import socket
import struct
import threading
from collections.abc import Callable

from ftjob.ft.allreduce.process_group import split_address

log = logging.getLogger("ftjob.group_link")

HELLO = struct.Struct("!II")  # rank, token length; the token follows
DOWN = struct.Struct("!q")  # abort_below, or BYE_DOWN: rank 0 is shutting down cleanly
UP = struct.Struct("!qB")  # progress counter, flags
WAITING, BYE = 1, 2
BYE_DOWN = -1
MAX_TOKEN = 4096
CONNECT_TIMEOUT_S = 30.0


def _nodelay(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # 8-byte frames must not wait for an ACK
    return sock


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        try:
            chunk = sock.recv(n - len(buf))
        except OSError:
            return None
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


class _Conn:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.rank: int | None = None  # set once authenticated
        self.bye = False


class LinkServer:
    """Rank 0's end: accepts the group's other ranks, forwards aborts down, and folds their progress into the
    group's: ``on_change(min of the ranks' counters, every rank waiting)``, called on whichever thread changed it."""

    def __init__(
        self,
        token: str,
        advertise_addr: str,
        world_size: int,
        on_change: Callable[[int, bool], None],
        on_lost: Callable[[str], None],
    ) -> None:
        self._token = token.encode()
        self._world = world_size
        self._on_change, self._on_lost = on_change, on_lost
        self._listener = socket.create_server(("0.0.0.0", 0))
        self.address = f"{advertise_addr}:{self._listener.getsockname()[1]}"
        self._peers: dict[int, socket.socket] = {}
        self._progress = [0] * world_size
        self._waiting = [False] * world_size
        self._abort_below = 0
        self._lock = threading.Lock()  # peers, frames written, the folded progress
        self._all_in = threading.Event()
        self._closing = False
        self.lost: str | None = None
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._wake_r, self._wake_w = socket.socketpair()  # close() wakes the selector
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(target=self._serve, name="group-link", daemon=True)
        self._thread.start()

    def wait_connected(self, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        """Blocks until every other rank of the group opened its link; ConnectionError naming the missing ranks
        after ``timeout_s``."""
        if not self._all_in.wait(timeout_s):
            missing = sorted(set(range(1, self._world)) - set(self._peers))
            raise ConnectionError(f"ranks {missing} of this group did not open their group link in {timeout_s:g}s")

    def forward(self, abort_below: int) -> None:
        """Sends an abort signal to every other rank now (the lighthouse client's thread)."""
        frame = DOWN.pack(abort_below)
        with self._lock:
            self._abort_below = abort_below
            for sock in self._peers.values():
                try:
                    sock.sendall(frame)
                except OSError:
                    pass  # its reader notices the drop

    def report(self, progress: int, waiting: bool) -> None:
        """Rank 0's own counter and flag (training thread)."""
        self._progress[0], self._waiting[0] = progress, waiting
        self._fold()

    def _fold(self) -> None:
        with self._lock:
            self._on_change(min(self._progress), all(self._waiting))

    def close(self) -> None:
        """Says goodbye to every other rank and closes their links (a clean shutdown, not a lost rank)."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            for sock in self._peers.values():
                try:
                    sock.sendall(DOWN.pack(BYE_DOWN))
                except OSError:
                    pass
        self._wake_w.send(b"x")
        self._thread.join(5)
        for sock in (self._listener, self._wake_r, self._wake_w, *self._peers.values()):
            sock.close()
        self._sel.close()

    # --- selector thread ---------------------------------------------------------------------------------------
    def _serve(self) -> None:
        while True:
            for key, _ in self._sel.select():
                if key.data == "wake":
                    return
                if key.data is None:
                    sock, _addr = self._listener.accept()
                    self._sel.register(_nodelay(sock), selectors.EVENT_READ, _Conn(sock))
                else:
                    self._read(key.data)

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(65536)
        except OSError:
            data = b""
        if not data:
            self._dropped(conn)
            return
        conn.buf += data
        if conn.rank is None and not self._hello(conn):
            return
        changed = False
        while len(conn.buf) >= UP.size and conn.rank is not None:
            progress, flags = UP.unpack_from(conn.buf)
            del conn.buf[: UP.size]
            conn.bye = conn.bye or bool(flags & BYE)
            self._progress[conn.rank], self._waiting[conn.rank] = progress, bool(flags & WAITING)
            changed = True
        if changed:
            self._fold()

    def _hello(self, conn: _Conn) -> bool:
        """Authenticates a new connection once its hello is complete; False while incomplete or refused."""
        if len(conn.buf) < HELLO.size:
            return False
        rank, n = HELLO.unpack_from(conn.buf)
        if n > MAX_TOKEN or not 0 < rank < self._world or rank in self._peers:
            return self._refuse(conn, f"a group link hello for rank {rank} (token of {n} bytes) was refused")
        if len(conn.buf) < HELLO.size + n:
            return False
        token = bytes(conn.buf[HELLO.size : HELLO.size + n])
        del conn.buf[: HELLO.size + n]
        if not hmac.compare_digest(token, self._token):
            return self._refuse(conn, f"a group link claiming rank {rank} sent a wrong token")
        with self._lock:
            conn.rank = rank
            self._peers[rank] = conn.sock
            try:
                conn.sock.sendall(DOWN.pack(self._abort_below))  # the welcome: aborts already heard
            except OSError:
                pass
        if len(self._peers) == self._world - 1:
            self._all_in.set()
        return True

    def _refuse(self, conn: _Conn, why: str) -> bool:
        log.warning("%s; closing it", why)
        self._sel.unregister(conn.sock)
        conn.sock.close()
        return False

    def _dropped(self, conn: _Conn) -> None:
        self._sel.unregister(conn.sock)
        conn.sock.close()
        with self._lock:
            if conn.rank is not None:
                self._peers.pop(conn.rank, None)
            if conn.rank is None or conn.bye or self._closing or self.lost is not None:
                return
            self.lost = f"rank {conn.rank} of this replica group dropped its group link (its process died?)"
            for sock in self._peers.values():  # every other rank hears it as its own link dropping
                self._sel.unregister(sock)
                sock.close()
            self._peers.clear()
        log.warning("%s", self.lost)
        self._on_lost(self.lost)


class LinkClient:
    """A rank > 0's end: connects to rank 0 (blocking until authenticated), reads aborts on its own thread."""

    def __init__(
        self,
        address: str,
        token: str,
        rank: int,
        on_abort: Callable[[int], None],
        on_lost: Callable[[str], None],
    ) -> None:
        self._on_abort, self._on_lost = on_abort, on_lost
        self._sock = _nodelay(socket.create_connection(split_address(address), timeout=CONNECT_TIMEOUT_S))
        raw = token.encode()
        self._sock.sendall(HELLO.pack(rank, len(raw)) + raw)
        welcome = _recv_exact(self._sock, DOWN.size)
        if welcome is None:
            self._sock.close()
            raise ConnectionError(f"rank 0 of this group at {address} refused the group link (the job token?)")
        self._sock.settimeout(None)
        self.abort_below: int = DOWN.unpack(welcome)[0]
        self.lost: str | None = None
        self._closing = False
        self._progress = 0
        self._thread = threading.Thread(target=self._read, name="group-link", daemon=True)
        self._thread.start()

    def report(self, progress: int, waiting: bool) -> None:
        """This rank's counter and flag, to rank 0 (training thread)."""
        self._progress = progress
        try:
            self._sock.sendall(UP.pack(progress, WAITING if waiting else 0))
        except OSError:
            pass  # the reader notices the drop

    @property
    def reading(self) -> bool:
        """Whether this rank still reads the link from rank 0 (False once it closed, cleanly or not)."""
        return self._thread.is_alive()

    def _read(self) -> None:
        while (frame := _recv_exact(self._sock, DOWN.size)) is not None:
            value = DOWN.unpack(frame)[0]
            if value == BYE_DOWN:
                self._closing = True
                break
            self.abort_below = value
            self._on_abort(value)
        if not self._closing:
            self.lost = "rank 0 of this replica group dropped the group link (its process died?)"
            log.warning("%s", self.lost)
            self._on_lost(self.lost)

    def close(self) -> None:
        """Says goodbye to rank 0 (a clean shutdown, not a lost rank) and closes the link."""
        self._closing = True
        try:
            self._sock.sendall(UP.pack(self._progress, BYE))
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the reader
        except OSError:
            pass
        self._thread.join(5)
        self._sock.close()
