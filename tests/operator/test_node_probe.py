"""Asking a node directly whether it still answers (ftjob.operator.reconcile.node_probe), on loopback sockets."""

from __future__ import annotations

import asyncio
import socket

from ftjob.operator.planning.node_health import NodeView
from ftjob.operator.reconcile.node_probe import NodeProbe


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once the socket is closed: connections are refused


def test_a_listening_kubelet_answers_and_a_closed_one_does_not() -> None:
    with socket.socket() as live:
        live.bind(("127.0.0.1", 0))
        live.listen()
        nodes = {
            "alive": NodeView(ready=True, address="127.0.0.1", kubelet_port=live.getsockname()[1]),
            "dead": NodeView(ready=True, address="127.0.0.1", kubelet_port=closed_port()),
            "unknown": NodeView(ready=True),  # no address: cannot be asked, so never reported
        }
        lost = asyncio.run(NodeProbe().not_answering(nodes, ["alive", "dead", "unknown", "absent"]))
    assert lost == {"dead"}


def test_an_answer_is_remembered_briefly() -> None:
    port = closed_port()
    nodes = {"n": NodeView(ready=True, address="127.0.0.1", kubelet_port=port)}
    probe = NodeProbe(ttl_s=3600)
    assert asyncio.run(probe.not_answering(nodes, ["n"])) == {"n"}
    with socket.socket() as live:  # the node comes back on the same port, within the answer's lifetime
        live.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        live.bind(("127.0.0.1", port))
        live.listen()
        assert asyncio.run(probe.not_answering(nodes, ["n"])) == {"n"}
        assert asyncio.run(NodeProbe().not_answering(nodes, ["n"])) == set()


def test_node_view_reads_the_kubelet_endpoint() -> None:
    status = {
        "addresses": [{"type": "Hostname", "address": "node-1"}, {"type": "InternalIP", "address": "10.0.0.7"}],
        "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
        "conditions": [{"type": "Ready", "status": "True"}],
    }
    view = NodeView.from_node({}, status)
    assert (view.address, view.kubelet_port, view.ready) == ("10.0.0.7", 10250, True)
