"""Free loopback ports for the processes a test starts."""

from __future__ import annotations

import random
import socket


def free_port() -> int:
    """A free loopback port for a process to bind later, chosen below the kernel's ephemeral range (32768 up), so the
    many connections a test opens meanwhile cannot take it (binding port 0 would pick from that range)."""
    for _ in range(1000):
        port = random.randint(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port between 20000 and 32000")
