"""Not tests: the small training program the manager tests (and hack/bench/bench_failover.py) run in subprocesses.

    python tests/trainer/test_manager_worker.py --group 0 --lighthouse URL --steps 20 [...]

One replica group of one rank trains a tiny nn.Linear through the real Manager (gloo, loopback). Every step it prints
one JSON line {"event": "step", ...}; at the end {"event": "done", "digest", "step", "metrics"}. Its data is a pure
function of (step, contributor_rank), so groups at the same step hold bitwise-equal parameters.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from ftjob.trainer.manager import Manager, ManagerConfig, param_digest


def emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--group", required=True)
    p.add_argument("--lighthouse", required=True)
    p.add_argument("--token", default=os.environ.get("FTJOB_TOKEN", ""))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument("--collective-timeout", type=float, default=5.0)
    p.add_argument("--quorum-timeout", type=float, default=60.0)
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--step-delay", type=float, default=0.0, help="pacing: keeps a run long enough to act on")
    p.add_argument("--hang-at-step", type=int, default=-1, help="after joining this step's quorum, hang forever")
    args = p.parse_args(argv)

    torch.manual_seed(0)
    model = torch.nn.Linear(args.width, args.width)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = {"cursor": 0}

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": opt.state_dict(), "data": dict(data)}

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        data.update(state["data"])

    cfg = ManagerConfig(
        group=args.group,
        lighthouse_url=args.lighthouse,
        token=args.token,
        min_replicas=args.min_replicas,
        collective_timeout_s=args.collective_timeout,
        quorum_timeout_s=args.quorum_timeout,
    )
    mgr = Manager(cfg, state_dict, load_state_dict)
    emit(event="ready", group=args.group, pid=os.getpid())
    while mgr.step < args.steps:
        started = time.monotonic()
        q = mgr.start_quorum()
        if mgr.step == args.hang_at_step:
            emit(event="hanging", step=mgr.step)
            while True:
                time.sleep(3600)
        if q.contributing:
            gen = torch.Generator().manual_seed(1000 * data["cursor"] + q.contributor_rank)
            x = torch.randn(8, args.width, generator=gen)
            loss = (model(x) - x.flip(1)).pow(2).mean()
            loss.backward()
        mgr.allreduce_gradients(model.parameters())
        committed = mgr.should_commit()
        if committed:
            opt.step()
            data["cursor"] += q.num_contributors
        opt.zero_grad()
        emit(
            event="step",
            step=mgr.step,
            committed=committed,
            quorum_id=q.quorum_id,
            contributing=q.contributing,
            participants=q.participants,
            healed=q.healed,
            seconds=round(time.monotonic() - started, 4),
            time=time.time(),
            error=None if committed else mgr.last_error,
        )
        if args.step_delay:
            time.sleep(args.step_delay)
    digest = param_digest(model.parameters())
    mgr.report_finished(digest)
    emit(event="done", step=mgr.step, digest=digest, cursor=data["cursor"], metrics=mgr.metrics)
    mgr.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
