"""The small training program the manager tests (and hack/bench/bench_failover.py) run in subprocesses; local_job
starts it, and a real lighthouse, as local processes.

    python -m tests.support.manager_worker --group 0 --lighthouse URL --steps 20 [...]   (from the repo root)

One replica group of one rank trains a tiny nn.Linear through the real Manager (gloo, loopback). Every step it prints
one JSON line {"event": "step", ...}; at the end {"event": "done", "digest", "step", "metrics"}. Its data is a pure
function of (step, contributor_rank), so groups at the same step hold bitwise-equal parameters.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

BOOT = time.time()  # interpreter up: what the imports below cost is measured from here ("boot" event)

import torch  # noqa: E402
from ftjob.ft.integrity.digest import local_digest as param_digest  # noqa: E402
from ftjob.ft.integrity.digest import replica_tensors  # noqa: E402
from ftjob.ft.step.manager import Manager, ManagerConfig, Terminated  # noqa: E402

from tests.support.polling import wait_for  # noqa: E402

IMPORTED = time.time()


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
    p.add_argument("--lost-timeout", type=float, default=600.0)
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--step-delay", type=float, default=0.0, help="pacing: keeps a run long enough to act on")
    p.add_argument("--hang-at-step", type=int, default=-1, help="after joining this step's quorum, hang forever")
    p.add_argument("--pause-at-step", type=int, default=-1, help="before this step, wait until --resume-file exists")
    p.add_argument("--resume-file", default="")
    p.add_argument("--join-file", default="", help="start up, then join the job only once this file exists")
    p.add_argument("--rank", type=int, default=0, help="rank inside the group (HSDP: the model is FSDP2-sharded)")
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--master-port", type=int, default=0, help="the group's own rendezvous port (world size > 1)")
    p.add_argument("--digest-every", type=int, default=0, help="state digests every N committed steps (0: none)")
    p.add_argument("--sigterm-at-step", type=int, default=-1, help="SIGTERM to itself in the middle of this step")
    p.add_argument("--own-sigterm-handler", action="store_true", help="a SIGTERM handler of its own (only reports)")
    args = p.parse_args(argv)
    if args.own_sigterm_handler:  # a script's own handler: the Manager must leave it alone
        signal.signal(signal.SIGTERM, lambda *_: emit(event="own_sigterm_handler"))
    # startup timeline (hack/bench/bench_failover.py's rejoin breakdown): interpreter up, imports done
    emit(event="boot", group=args.group, time=BOOT, imported=IMPORTED)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(args.width, args.width), torch.nn.Linear(args.width, args.width))
    if args.world_size > 1:  # HSDP: shard inside the group, replicate fault-tolerantly across groups
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{args.master_port}", rank=args.rank, world_size=args.world_size
        )
        mesh = init_device_mesh("cpu", (args.world_size,))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)  # torch.optim's first use imports torch._dynamo
    built = time.time()
    data = {"cursor": 0}

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": opt.state_dict(), "data": dict(data)}

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        data.update(state["data"])

    cfg = ManagerConfig(
        group=args.group,
        rank=args.rank,
        world_size=args.world_size,
        lighthouse_url=args.lighthouse,
        token=args.token,
        min_replicas=args.min_replicas,
        collective_timeout_s=args.collective_timeout,
        quorum_timeout_s=args.quorum_timeout,
        lost_timeout_s=args.lost_timeout,
        digest_every=args.digest_every,
    )
    if args.join_file:  # lets a test start a replacement process ahead and pick the moment it registers
        emit(event="started", group=args.group)
        wait_for(lambda: os.path.exists(args.join_file), 600, f"{args.join_file} to exist", interval=0.05)
    mgr = Manager(cfg, state_dict, load_state_dict, replica_state=lambda: replica_tensors(model, opt))
    mgr.register_params(model.parameters())  # buckets all-reduced during the backward (one rank per group)
    emit(event="ready", group=args.group, pid=os.getpid(), time=time.time(), built=built,
         handles_sigterm=mgr.handles_sigterm)  # fmt: skip
    try:
        train(args, mgr, model, opt, data)
    except Terminated as e:  # SIGTERM: the group left after its last step event; the process exits 143
        emit(event="terminated", step=mgr.step, why=str(e))
        mgr.shutdown()
        raise
    digest = param_digest(model.parameters())
    mgr.report_finished(digest)  # with HSDP: rank 0's shard digest (each rank prints its own below)
    emit(event="done", step=mgr.step, digest=digest, cursor=data["cursor"], metrics=mgr.metrics)
    mgr.shutdown()
    return 0


def train(args: argparse.Namespace, mgr: Manager, model: torch.nn.Module, opt: torch.optim.Optimizer,
          data: dict[str, int]) -> None:  # fmt: skip
    """The training loop: one "step" event per attempt."""
    while mgr.step < args.steps:
        if mgr.step == args.pause_at_step:  # lets a test start another group while this one is mid-run
            emit(event="paused", step=mgr.step)
            wait_for(lambda: os.path.exists(args.resume_file), 600, f"{args.resume_file} to exist", interval=0.05)
        started = time.monotonic()
        q = mgr.start_quorum()
        t_quorum = time.time()  # the quorum answered and, if behind, this group healed
        if mgr.step == args.hang_at_step:
            emit(event="hanging", step=mgr.step)
            while True:
                time.sleep(3600)
        if q.contributing:
            gen = torch.Generator().manual_seed(1000 * data["cursor"] + 10 * q.contributor_rank + args.rank)
            x = torch.randn(8, args.width, generator=gen)
            loss = (model(x) - x.flip(1)).pow(2).mean()
            loss.backward()
        mgr.allreduce_gradients(model.parameters())
        if mgr.step == args.sigterm_at_step:
            emit(event="sigterm", step=mgr.step)
            os.kill(os.getpid(), signal.SIGTERM)  # as the kubelet's: the step in flight must still commit
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
            heal_seconds=round(mgr.metrics["heal_seconds"], 4),  # cumulative; the rejoin breakdown uses the first
            quorum_time=t_quorum,
            seconds=round(time.monotonic() - started, 4),
            time=time.time(),
            error=None if committed else mgr.last_error,
            digest=param_digest(model.parameters()),  # after this attempt (a failed one must change nothing)
        )
        if args.step_delay:
            time.sleep(args.step_delay)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
