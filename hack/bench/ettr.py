"""Effective training time ratio (ETTR) at scale: a Monte Carlo over failure times, ftjob vs checkpoint-restart.

ETTR = useful GPU-seconds / GPU-seconds paid for. Failures arrive as a Poisson process (default one per 30 min at
100,000 GPUs) with a mix of kinds; each kind costs what this project measured for it (flags, defaults below):

  ftjob          a failure stalls every group for ``stall`` seconds (the survivors' gap between commits) and takes
                 the failed replica group (``gpus_per_group`` GPUs) out for ``detect + replace + rejoin`` seconds
                 while the others keep training (a lighthouse loss takes no group out, it only stalls);
                 the healthy step is ``step_ratio`` x plain DDP's, paid all the time.
  checkpoint-    every failure stops the whole job: the work since the last checkpoint is lost, then
  restart        ``restart`` seconds to reschedule, start and load; checkpoints every Young/Daly interval
                 tau = sqrt(2 * checkpoint_write * MTBF) cost ``checkpoint_write`` seconds each.

Default figures (this machine, see README's benchmark notes; override with flags when you measure anew):
  crash          SIGKILL of a group: survivors' stall 0.07 s median (bench_failover --kills), replaced and
                 contributing again in 6.3 s median in the cluster (pod failure -> replacement contributing,
                 bench_operator)
  hang           a silent group (SIGSTOP, no socket reset): the lighthouse's stall rule evicts it, survivors' stall
                 1.03 s at worst (bench_failover --stops; 0.52 s median); the operator replaces it at once (reason
                 Stalled), then 6.3 s to contribute
  node           a node lost (NotReady after the kubelet's grace): stall 7.2 s (the lighthouse-on-a-killed-node
                 figure bounds it), replacement 40 s + 6.3 s
  lighthouse     the lighthouse pod lost: longest gap 0.97 s (graceful/force-deleted) to 6.85 s (node killed); 3 s
Usage: python hack/bench/ettr.py [--gpus 100000 --mtbf-min 30 --days 30 --trials 200 ...]
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class FailureKind:
    name: str
    share: float  # of all failures
    stall_s: float  # every group waits this long
    out_s: float  # the failed group contributes nothing this long (detect + replace + rejoin); 0: no group lost


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=100_000)
    p.add_argument("--gpus-per-group", type=int, default=8 * 8, help="one replica group (e.g. 8 nodes x 8 GPUs)")
    p.add_argument("--mtbf-min", type=float, default=30.0, help="mean time between failures of the whole job")
    p.add_argument("--days", type=float, default=30.0, help="simulated training time per trial")
    p.add_argument("--trials", type=int, default=200)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--mix", default="crash=0.55,hang=0.15,node=0.27,lighthouse=0.03", help="failure shares")
    p.add_argument("--crash", default="0.07,6.3", help="stall_s,out_s of a crashed group")
    p.add_argument("--hang", default="1.03,7.3", help="stall_s,out_s of a silent (hung) group")
    p.add_argument("--node", default="7.2,46.3", help="stall_s,out_s of a lost node's group")
    p.add_argument("--lighthouse", default="3.0,0", help="stall_s,out_s of a lost lighthouse")
    p.add_argument("--step-ratio", type=float, default=1.021, help="ftjob's healthy step / plain DDP's (bench_trainer)")
    p.add_argument("--checkpoint-write-s", type=float, default=60.0, help="C/R: one synchronous checkpoint")
    p.add_argument("--restart-s", type=float, default=600.0, help="C/R: detect, reschedule, start, load")
    return p.parse_args()


def failure_kinds(args: argparse.Namespace) -> list[FailureKind]:
    shares = {k: float(v) for k, v in (item.split("=") for item in args.mix.split(","))}
    total = sum(shares.values())
    kinds = []
    for name, share in shares.items():
        stall, out = (float(x) for x in getattr(args, name).split(","))
        kinds.append(FailureKind(name, share / total, stall, out))
    return kinds


def failure_times(rng: random.Random, horizon_s: float, mtbf_s: float) -> list[float]:
    times, t = [], rng.expovariate(1.0 / mtbf_s)
    while t < horizon_s:
        times.append(t)
        t += rng.expovariate(1.0 / mtbf_s)
    return times


def ftjob_trial(rng: random.Random, args: argparse.Namespace, kinds: list[FailureKind]) -> float:
    """GPU-time fraction spent on committed work: job-wide stalls and each failed group's absence are lost."""
    horizon = args.days * 86400
    groups = args.gpus / args.gpus_per_group
    lost_group_s = 0.0  # group-seconds not contributing (the job goes on with the others)
    stalled_s = 0.0  # wall seconds every group waited
    for _t in failure_times(rng, horizon, args.mtbf_min * 60):
        kind = rng.choices(kinds, weights=[k.share for k in kinds])[0]
        stalled_s += kind.stall_s
        lost_group_s += kind.out_s
    useful = (horizon - stalled_s) * groups - lost_group_s
    return useful / (horizon * groups) / args.step_ratio


def checkpoint_restart_trial(rng: random.Random, args: argparse.Namespace) -> float:
    """Young/Daly: checkpoints every tau; a failure loses the work since the last one, then the restart."""
    horizon, mtbf = args.days * 86400, args.mtbf_min * 60
    tau = math.sqrt(2 * args.checkpoint_write_s * mtbf)
    t, useful = 0.0, 0.0
    next_failure = rng.expovariate(1.0 / mtbf)
    while t < horizon:
        segment_end = t + tau + args.checkpoint_write_s  # train tau, then write a checkpoint
        if next_failure >= segment_end:
            useful += tau
            t = segment_end
            continue
        t = next_failure + args.restart_s  # the segment's work is lost; restart from the last checkpoint
        next_failure = t + rng.expovariate(1.0 / mtbf)
    return min(useful, horizon) / horizon


def main() -> None:
    args = parse_args()
    kinds = failure_kinds(args)
    rng = random.Random(args.seed)
    ft = [ftjob_trial(rng, args, kinds) for _ in range(args.trials)]
    cr = [checkpoint_restart_trial(rng, args) for _ in range(args.trials)]
    tau = math.sqrt(2 * args.checkpoint_write_s * args.mtbf_min * 60)
    print(
        f"[ettr] {args.gpus:,} GPUs in groups of {args.gpus_per_group}, one failure per {args.mtbf_min:g} min, "
        f"{args.days:g} days x {args.trials} trials"
    )
    for k in kinds:
        print(f"[ettr]   {k.name:<10} {k.share:5.1%}  stall {k.stall_s:6.2f}s  group out {k.out_s:6.1f}s")
    print(
        f"[ettr] ftjob (healthy step x{args.step_ratio:g} of DDP):   ETTR median {statistics.median(ft):.4f}  "
        f"min {min(ft):.4f}"
    )
    print(f"[ettr] ftjob, failures only (step x1):      ETTR median {statistics.median(ft) * args.step_ratio:.4f}")
    print(
        f"[ettr] checkpoint-restart (tau {tau / 60:.1f} min, write {args.checkpoint_write_s:g}s, restart "
        f"{args.restart_s:g}s): ETTR median {statistics.median(cr):.4f}  min {min(cr):.4f}"
    )
    print(f"[ettr] ftjob / checkpoint-restart: {statistics.median(ft) / statistics.median(cr):.3f}")


if __name__ == "__main__":
    main()
