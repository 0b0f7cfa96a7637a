"""torchft's side of hack/bench/bench_failover.py's rejoin figure: the same tiny model and loop as ours
(tests/support/manager_worker.py: two nn.Linear(64, 64), Adam, one rank per group, a 0.02 s pause per step),
coordinated by torchft (0.2.0, as the ``bench`` extra pins it: its Rust lighthouse, Manager, reconfigurable gloo
process group and DDP wrapper) instead of ftjob. The worker prints the same JSON events as ours (boot, ready, step),
so the bench measures a restarted group's process start -> first commit -> first contributing commit the same way
for both.

The worker imports only what a torchft training script needs (torch, torchft): its import cost is torchft's own.

    python hack/bench/torchft_rejoin.py worker --group 2 --lighthouse http://127.0.0.1:PORT
    python hack/bench/torchft_rejoin.py lighthouse --port PORT
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

BOOT = time.time()  # interpreter up (the "boot" event); the rest of the imports are inside the child's functions

WIDTH = 64
STEP_DELAY_S = 0.02  # as bench_failover's WORKER_ARGS
TIMEOUT_S = 5.0  # collective timeout (torchft_runner's TIMEOUT)
JOIN_TIMEOUT_MS = 500  # as bench_failover's ftjob lighthouse (--join-timeout 0.5)


def torchft_label() -> str:
    """The label "torchft VERSION" as installed (the ``bench`` extra pins the one measured), without importing it."""
    for dist in ("torchft", "torchft-nightly"):
        try:
            return f"torchft {importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return "torchft"


def emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def lighthouse_main(port: int) -> None:
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind=f"127.0.0.1:{port}", min_replicas=1, join_timeout_ms=JOIN_TIMEOUT_MS)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"[torchft] lighthouse {server.address()}", flush=True)
    try:
        while True:
            time.sleep(0.2)
    finally:
        server.shutdown()


def worker_main(group: int, lighthouse: str) -> None:
    from datetime import timedelta

    import torch
    from torch.distributed import TCPStore
    from torchft.ddp import DistributedDataParallel
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    emit(event="boot", group=str(group), time=BOOT, imported=time.time())
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, WIDTH))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    built = time.time()
    data = {"cursor": 0}

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": opt.state_dict(), "data": dict(data)}

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        data.update(state["data"])

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # the group's store (one rank)
    timeout = timedelta(seconds=TIMEOUT_S)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,
        timeout=timeout,
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=lighthouse,
        replica_id=f"group_{group}",  # torchft appends a fresh uuid: a restart is a new incarnation
        hostname="127.0.0.1",
        init_sync=False,  # same seeded weights everywhere; a restarted group behind the job still heals
    )
    ddp = DistributedDataParallel(manager, model)
    emit(event="ready", group=str(group), pid=os.getpid(), time=time.time(), built=built)
    while True:
        started = time.monotonic()
        manager.start_quorum()
        gen = torch.Generator().manual_seed(1000 * data["cursor"] + group)
        x = torch.randn(8, WIDTH, generator=gen)
        (ddp(x) - x.flip(1)).pow(2).mean().backward()
        contributing = manager.is_participating()  # False while healing: its gradients count as zeros
        committed = manager.should_commit()
        if committed:
            opt.step()
            data["cursor"] += 1
        opt.zero_grad()
        emit(event="step", step=manager.current_step(), committed=committed, contributing=contributing,
             seconds=round(time.monotonic() - started, 4), time=time.time())  # fmt: skip
        time.sleep(STEP_DELAY_S)


class TorchftJob:
    """torchft's lighthouse and groups as local processes (in the bench's process: the imports are done there)."""

    def __init__(self, workdir: Path, groups: list[str]) -> None:
        from ftjob.launch.procs import free_port

        from hack.bench.torchft_runner import wait_listening

        self.workdir = workdir
        self.env = {"OMP_NUM_THREADS": "1"}
        port = free_port()
        log = workdir / "torchft-lighthouse.log"
        self.lighthouse = subprocess.Popen(
            [sys.executable, __file__, "lighthouse", f"--port={port}"],
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
            env={**os.environ, **self.env},
        )
        wait_listening(port, self.lighthouse, log)
        self.url = f"http://127.0.0.1:{port}"
        self.groups = {g: self.start(g) for g in groups}

    def start(self, group: str) -> Any:
        """A torchft group read like ours: tests.support.local_job.Worker (events, kill) on this file's worker."""
        from tests.support.local_job import Worker

        return Worker(self.workdir, self.url, group, env=self.env, command=[sys.executable, __file__, "worker"])

    def close(self) -> None:
        from hack.bench.torchft_runner import _stop

        _stop([w.proc for w in self.groups.values()] + [self.lighthouse])


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["worker", "lighthouse"])
    p.add_argument("--group", type=int, default=0)
    p.add_argument("--lighthouse", default="")
    p.add_argument("--port", type=int, default=0)
    a = p.parse_args(argv)
    if a.mode == "lighthouse":
        lighthouse_main(a.port)
    else:
        worker_main(a.group, a.lighthouse)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
