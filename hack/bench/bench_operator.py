#!/usr/bin/env python
"""Operator benchmark on the local cluster (hack/cluster): how fast a failed replica group is handled, and how fast
a large job's pods are created.

Recovery (a real training job: `ftjob-trainer train --model tiny`, 3 contributing groups, minReplicas 2), measured
over N kills of a contributing group's trainer process (SIGKILL), without and with one hot spare:
  (a) failure -> the operator has told the lighthouse to evict the group   (operator log timestamp)
  (b) failure -> the replacement group's pods exist                         (pod watch ADDED time)
      (and, for diagnosis, -> they are Running: the kubelet's and containerd's part)
  (c) failure -> `replicas` groups contribute again in the lighthouse quorum (lighthouse status, polled every 50 ms)
Scale: a 1,024-pod job (128 groups x 8 ranks, pods run `sleep`): job created -> every pod exists.
Goals: (a) <= 1 s, (b) <= 1 s, (c) <= 10 s (<= 2 s with a spare), 1,024 pods <= 30 s.

Run from the repo root:
`python -m hack.bench.bench_operator [--kills 20] [--omp-threads 1] [--skip-scale] [--schedule-scale-pods]`.
Needs root (it kills pod processes in their network namespaces) and takes ~10-15 minutes for 20 kills per variant.
"""

from __future__ import annotations

import argparse
import datetime as dt
import re
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

from ftjob import contract
from ftjob.contract.lighthouse_api import MemberStatus, StatusResponse
from kubernetes import client, config, watch

from tests.support.cluster import CLUSTER, kubectl, state_dir
from tests.support.operator_cluster import (
    CRD,
    create_job,
    job_manifest,
    kill_pod_processes,
    lighthouse_status,
    start_operator,
)
from tests.support.polling import wait_for

TRAIN = ["ftjob-trainer", "train", "--model", "tiny", "--steps", "1000000", "--corpus-bytes", "262144",
         "--batch-size", "4", "--log-every", "100"]  # fmt: skip
REPLICAS = 3
EVICT_LINE = re.compile(r"^(\S+ \S+) INFO ftjob\.operator\.worker: \S+/(\S+): lighthouse evicted group (\d+) ")


def say(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class PodWatch:
    """Records when each pod of the namespace was first seen (watch ADDED), in wall-clock seconds."""

    def __init__(self, core: client.CoreV1Api, namespace: str) -> None:
        self.core, self.namespace = core, namespace
        self.first_seen: dict[str, float] = {}
        self.running_at: dict[str, float] = {}
        self.labels: dict[str, dict[str, str]] = {}
        self._stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop:
            w = watch.Watch()
            try:
                for ev in w.stream(self.core.list_namespaced_pod, self.namespace, timeout_seconds=60):
                    name = ev["object"].metadata.name
                    if name not in self.first_seen:
                        self.first_seen[name] = time.time()
                        self.labels[name] = ev["object"].metadata.labels or {}
                    if ev["object"].status.phase == "Running" and name not in self.running_at:
                        self.running_at[name] = time.time()
                    if self._stop:
                        break
            except Exception as e:  # a dropped watch is restarted; names already seen keep their first time
                say(f"pod watch restarted: {e}")

    def count(self, job: str, role: str = contract.ROLE_WORKER) -> int:
        return sum(
            1 for lab in list(self.labels.values()) if lab.get(contract.LABEL_JOB) == job
            and lab.get(contract.LABEL_ROLE) == role
        )  # fmt: skip

    def stop(self) -> None:
        self._stop = True


def evictions(log: Path, job: str) -> list[tuple[float, int]]:
    out = []
    for line in log.read_text(errors="replace").splitlines():
        m = EVICT_LINE.match(line)
        if m and m.group(2) == job:
            t = dt.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            out.append((t, int(m.group(3))))
    return out


def contributors(status: StatusResponse, exclude_incarnation: str | None = None) -> list[MemberStatus]:
    return [
        m
        for m in status.members
        if m.contributing and m.in_quorum and not m.healing and m.incarnation != exclude_incarnation
    ]


def full_strength(core: client.CoreV1Api, ns: str, job: str, spare: int) -> StatusResponse | None:
    status = lighthouse_status(core, ns, job)
    members = [m for m in status.members if not m.healing]
    if len(contributors(status)) == REPLICAS and len(members) == REPLICAS + spare and status.max_step > 2:
        return status
    return None


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def run_recovery(core, custom, ns: str, op_log: Path, watcher: PodWatch, spare: int, kills: int,
                 omp_threads: int) -> dict:  # fmt: skip
    job = f"rec-s{spare}"
    manifest = job_manifest(
        job,
        command=TRAIN,
        replicas=REPLICAS,
        minReplicas=2,
        spareReplicas=spare,
        lighthouse={"heartbeatTimeoutSeconds": 5},
        failurePolicy={"maxRestartsPerGroup": 1000, "maxTotalRestarts": 100000},
    )
    if omp_threads:  # as the example jobs set it: the 3 trainers and a replacement share the node's cores
        manifest["spec"]["template"]["spec"]["containers"][0]["env"] = [
            {"name": "OMP_NUM_THREADS", "value": str(omp_threads)}
        ]
    create_job(custom, ns, manifest)
    say(f"{job}: waiting for {REPLICAS} contributing groups (+{spare} spare) to train")
    wait_for(lambda: full_strength(core, ns, job, spare), 600, f"{job} at full strength", interval=0.5)
    a, b, r, c = [], [], [], []
    for k in range(kills):
        status = wait_for(lambda: full_strength(core, ns, job, spare), 300, f"{job} back at full strength",
                          interval=0.2)  # fmt: skip
        target = contributors(status)[k % REPLICAS]
        group, incarnation = int(target.group), target.incarnation
        pods = core.list_namespaced_pod(
            ns, label_selector=f"{contract.LABEL_JOB}={job},{contract.LABEL_GROUP}={group}"
        ).items
        victim = next(p for p in pods if p.status.phase == "Running" and p.metadata.deletion_timestamp is None)
        old_gen = int(victim.metadata.labels[contract.LABEL_GENERATION])
        t0 = time.time()
        kill_pod_processes(victim)

        def evicted(g: int = group, since: float = t0) -> float | None:
            return next((t for t, eg in evictions(op_log, job) if eg == g and t >= since - 0.01), None)

        def replacement(g: int = group, gen: int = old_gen, table: dict | None = None) -> float | None:
            table = watcher.first_seen if table is None else table
            times = [
                t for name, t in list(table.items())
                if watcher.labels[name].get(contract.LABEL_JOB) == job
                and watcher.labels[name].get(contract.LABEL_GROUP) == str(g)
                and int(watcher.labels[name].get(contract.LABEL_GENERATION, "-1")) > gen
            ]  # fmt: skip
            return min(times) if times else None

        # polled every 50 ms (the measurement's resolution); a lighthouse briefly not answering is a "not yet"
        tc = wait_for(
            lambda i=incarnation: len(contributors(lighthouse_status(core, ns, job), i)) == REPLICAS and time.time(),
            300,
            f"{job}: {REPLICAS} contributors back after kill {k + 1}",
            interval=0.05,
        )
        ta = wait_for(evicted, 60, f"eviction of group {group} in the operator log")
        tb = wait_for(replacement, 60, f"replacement pods of group {group}")
        tr = wait_for(lambda: replacement(table=watcher.running_at), 120, f"replacement of group {group} Running")
        a.append(ta - t0)
        b.append(tb - t0)
        r.append(tr - t0)
        c.append(tc - t0)
        say(f"{job} kill {k + 1}/{kills} group {group}: evicted {a[-1]:.3f}s, pods {b[-1]:.3f}s, "
            f"running {r[-1]:.3f}s, contributing {c[-1]:.3f}s")  # fmt: skip
    custom.delete_namespaced_custom_object(contract.API_GROUP, contract.API_VERSION, ns, contract.PLURAL, job)
    wait_for(lambda: not core.list_namespaced_pod(ns, label_selector=f"{contract.LABEL_JOB}={job}").items, 300,
             f"{job}'s pods gone")  # fmt: skip
    return {"evicted": a, "pods": b, "pods-running": r, "contributing": c}


def run_scale(core, custom, ns: str, watcher: PodWatch, schedule: bool) -> tuple[float, int]:
    job = "scale"
    template_spec: dict = {}
    if not schedule:  # pods stay Pending: this measures the operator and the apiserver, not 1,024 process starts
        template_spec["nodeSelector"] = {"ftjob.dev/bench": "no-such-node"}
    manifest = job_manifest(job, command=["sleep", "100000"], replicas=128, podsPerReplica=8)
    manifest["spec"]["template"]["spec"].update(template_spec)
    t0 = time.time()
    create_job(custom, ns, manifest)
    last = 0
    while watcher.count(job) < 1024:
        n = watcher.count(job)
        if n // 128 != last // 128:
            say(f"scale: {n}/1024 pods after {time.time() - t0:.1f}s")
        last = n
        if time.time() - t0 > 600:
            raise SystemExit(f"only {n}/1024 pods after 600 s")
        time.sleep(0.05)  # poll period of the measurement
    names = [n for n, lab in list(watcher.labels.items()) if lab.get(contract.LABEL_JOB) == job
             and lab.get(contract.LABEL_ROLE) == contract.ROLE_WORKER]  # fmt: skip
    elapsed = max(watcher.first_seen[n] for n in names) - t0
    custom.delete_namespaced_custom_object(contract.API_GROUP, contract.API_VERSION, ns, contract.PLURAL, job)
    return elapsed, len(names)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kills", type=int, default=20, help="kills per variant (default 20)")
    p.add_argument(
        "--omp-threads",
        type=int,
        default=1,
        help="the trainers' OMP_NUM_THREADS, as the example jobs set it (0: unset, torch's default)",
    )
    p.add_argument("--skip-recovery", action="store_true")
    p.add_argument("--skip-scale", action="store_true")
    p.add_argument("--schedule-scale-pods", action="store_true",
                   help="let the 1,024 pods be scheduled and run (default: they stay Pending)")  # fmt: skip
    args = p.parse_args()
    if subprocess.run([str(CLUSTER), "status"], capture_output=True).returncode != 0:
        say("no healthy cluster: running hack/cluster up")
        subprocess.run([str(CLUSTER), "up"], check=True)
    kubeconfig = state_dir() / "kubeconfig"
    api = config.new_client_from_config(config_file=str(kubeconfig))
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    kubectl(kubeconfig, "apply", "-f", str(CRD))
    ns = f"bench-operator-{uuid.uuid4().hex[:6]}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=ns)))
    op_log = Path(f"/tmp/{ns}-operator.log")
    op = start_operator(kubeconfig, op_log, "--namespace", ns, "--no-leader-election")
    watcher = PodWatch(core, ns)
    results: dict[str, dict] = {}
    scale = None
    try:
        if not args.skip_recovery:
            for spare in (0, 1):
                run = run_recovery(core, custom, ns, op_log, watcher, spare, args.kills, args.omp_threads)
                results[f"spare={spare}"] = run
        if not args.skip_scale:
            scale = run_scale(core, custom, ns, watcher, args.schedule_scale_pods)
    finally:
        watcher.stop()
        op.stop()
        core.delete_namespace(ns)
        say(f"operator log: {op_log}")

    print("\n=== ftjob operator benchmark (local cluster, this machine, one run) ===")
    goals = {"evicted": 1.0, "pods": 1.0, "pods-running": None, "contributing": 10.0}
    for variant, r in results.items():
        for key, values in r.items():
            goal = 2.0 if key == "contributing" and variant == "spare=1" else goals[key]
            med, p95 = statistics.median(values), pct(values, 0.95)
            verdict = "(no goal: kubelet start-up)" if goal is None else (
                f"goal <= {goal:g}s: {'meets' if med <= goal else 'MISSES'}")  # fmt: skip
            print(f"{variant:8s} failure -> {key:13s} n={len(values):2d} median {med:7.3f}s  p95 {p95:7.3f}s  "
                  f"{verdict}")  # fmt: skip
    if scale is not None:
        elapsed, n = scale
        print(f"1,024-pod job: {n} pods exist {elapsed:.2f}s after the job was created (goal <= 30s: "
              f"{'meets' if elapsed <= 30 else 'MISSES'})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
