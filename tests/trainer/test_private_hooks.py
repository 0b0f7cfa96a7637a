"""The private torch and standard-library internals ftjob.ft still relies on keep the shape our code assumes.

Where a public API does the job the trainer uses it; these are the hooks left without one, so pyproject.toml pins torch
to the tested minor and these checks fail the moment a new release renames, drops or re-signs one of them:

- ``ftjob.ft.wrappers.ddp`` finds the output tensors to hook with ``torch.utils._pytree.tree_leaves`` (torch has no
  public pytree module).
- ``ftjob.ft.recovery.transport`` sets the receive window before the TCP handshake by replacing
  ``http.client.HTTPConnection._create_connection`` (the only seam between the socket's creation and its connect).

The beta public APIs it uses in their place (``torch.foreach.copy_``, ``torch.autograd.graph.queue_callback``) may
still change signature between minors, so their shape is checked here too.
"""

from __future__ import annotations

import http.client
import inspect
import re
import socket
from collections.abc import Callable
from typing import Any

import torch
from ftjob.contract.tls import NamedHTTPSConnection
from ftjob.ft.recovery.transport import _bounded_window
from torch.utils import _pytree


def params(fn: Callable[..., Any]) -> list[str]:
    """The parameter names of ``fn``."""
    return list(inspect.signature(fn).parameters)


def source(fn: Callable[..., Any]) -> str:
    """``fn``'s source without whitespace, so that a reformatting does not count as a change."""
    return "".join(inspect.getsource(fn).split())


# --- torch ----------------------------------------------------------------------------------------------------------


def test_tree_leaves_still_flattens_nested_outputs_to_their_tensors() -> None:
    assert callable(_pytree.tree_leaves)
    assert params(_pytree.tree_leaves)[0] == "tree"
    a, b, c = torch.zeros(1), torch.ones(2), torch.full((3,), 2.0)
    leaves = _pytree.tree_leaves({"loss": a, "parts": [b, (c, None)]})
    assert [t for t in leaves if isinstance(t, torch.Tensor)] == [a, b, c]


def test_foreach_copy_takes_destinations_then_sources() -> None:
    assert params(torch.foreach.copy_)[:2] == ["inputs", "src"]
    into, src = [torch.zeros(2), torch.zeros(3)], [torch.ones(2), torch.full((3,), 2.0)]
    torch.foreach.copy_(into, src)
    assert [t.tolist() for t in into] == [[1.0, 1.0], [2.0, 2.0, 2.0]]


def test_queue_callback_runs_after_the_backward_pass_it_was_queued_from() -> None:
    assert params(torch.autograd.graph.queue_callback) == ["callback"]
    ran: list[str] = []
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    y.register_hook(lambda _grad: torch.autograd.graph.queue_callback(lambda: ran.append("after")))
    y.sum().backward()
    assert ran == ["after"]


def test_the_nccl_group_still_takes_its_timeout_in_the_constructor() -> None:
    # ProcessGroupNCCL's construction needs a GPU; its bound overloads say whether a bare timeout is still accepted
    overloads = torch.distributed.ProcessGroupNCCL.__init__.__doc__ or ""
    assert re.search(r"\(self: [^,]+, store: [^,]+, rank: [^,]+, size: [^,]+, timeout: datetime\.timedelta", overloads)


# --- http.client ----------------------------------------------------------------------------------------------------


def test_the_connection_still_makes_its_socket_through_create_connection() -> None:
    conn = http.client.HTTPConnection("localhost", 1)
    assert conn._create_connection is socket.create_connection  # type: ignore[attr-defined]
    assert "self.sock=self._create_connection((self.host,self.port),self.timeout,self.source_address)" in source(
        http.client.HTTPConnection.connect
    )
    # the TLS connection reaches the same seam through the plain connect
    assert "http.client.HTTPConnection.connect(self)" in source(NamedHTTPSConnection.connect)


def test_our_replacement_takes_what_create_connection_is_called_with() -> None:
    assert params(_bounded_window) == params(socket.create_connection)[:3] == ["address", "timeout", "source_address"]
