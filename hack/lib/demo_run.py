"""hack/demo: the local cluster, the operator installed by its Helm chart, a sample job, one replica group killed while
it trains, every status transition printed as it happens, and a PNG timeline of the run. Ends when the job Succeeded.

Run through the `hack/demo` wrapper, which picks the project's Python environment.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import os
import shlex
import ssl
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client, config
from kubernetes.client.rest import ApiException

sys.path.insert(0, str(Path(__file__).resolve().parent))  # demo_timeline sits next to this file

from demo_timeline import Timeline, plot
from ftjob import contract
from ftjob.contract import pki
from ftjob.contract.lighthouse_api import StatusResponse
from ftjob.contract.tls import NamedHTTPSConnection, client_context
from ftjob.operator.state import names

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "ftjob-operator"
T0 = time.monotonic()


def say(msg: str) -> None:
    print(f"[demo {time.monotonic() - T0:6.1f}s] {msg}", flush=True)


class Shell:
    """helm/kubectl with the cluster's tools on PATH; each command is echoed so the user can repeat it."""

    def __init__(self) -> None:
        out = subprocess.run([str(REPO / "hack/cluster"), "env"], capture_output=True, text=True, check=True).stdout
        self.env = dict(os.environ)
        for line in out.splitlines():
            key, _, value = line.removeprefix("export ").partition("=")
            self.env[key] = value.replace("$PATH", self.env.get("PATH", ""))
        # the images hack/cluster built from this checkout and imported into every node (name -> reference)
        recorded = json.loads((Path(self.env["KUBECONFIG"]).parent / "images.json").read_text())
        self.images: dict[str, str] = {name: img["dev"] for name, img in recorded.items()}

    def run(self, *args: str, check: bool = True, echo: bool = True, stdin: str | None = None) -> str:
        if echo:
            print(f"  $ {shlex.join(args)}", flush=True)
        proc = subprocess.run(args, capture_output=True, text=True, env=self.env, input=stdin)
        if check and proc.returncode != 0:
            raise SystemExit(f"error: `{shlex.join(args)}` failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
        return proc.stdout

    def kubectl_json(self, *args: str) -> Any:
        out = self.run("kubectl", *args, "-o", "json", echo=False, check=False)
        return json.loads(out) if out.strip() else None

    def clients(self) -> tuple[client.CoreV1Api, client.CustomObjectsApi]:
        """API clients for the polling loop (cheaper than a kubectl process per poll on a busy machine)."""
        api = config.new_client_from_config(config_file=self.env["KUBECONFIG"])
        return client.CoreV1Api(api), client.CustomObjectsApi(api)


def cluster_up() -> None:
    say("bringing up the local cluster (hack/cluster up builds whatever is missing)")
    proc = subprocess.run([str(REPO / "hack/cluster"), "up"])
    if proc.returncode != 0:
        raise SystemExit(
            "error: hack/cluster up failed (see its output above); `hack/cluster logs` shows the components"
        )


def install_operator(sh: Shell, ns: str, release: str) -> None:
    if sh.run("helm", "status", release, "-n", ns, check=False, echo=False).strip():
        say(f"removing the previous demo release {release}")
        sh.run("helm", "uninstall", release, "-n", ns, "--wait")
    if sh.kubectl_json("get", "namespace", ns):
        say(f"removing the previous demo namespace {ns} (and its job)")
        sh.run("kubectl", "delete", "namespace", ns, "--wait=true", "--timeout=180s")
    say(f"installing the operator with its Helm chart into {ns} (it watches only {ns}: least privilege)")
    sh.run("kubectl", "create", "namespace", ns)
    sh.run(
        "helm",
        "install",
        release,
        str(CHART),
        "-n",
        ns,
        "--set",
        f"watchNamespaces={{{ns}}}",
        "--set",
        f"image.repository={sh.images['operator'].rsplit(':', 1)[0]}",
        "--set",
        f"image.tag={sh.images['operator'].rsplit(':', 1)[1]}",
        "--wait",
        "--timeout",
        "180s",
    )
    pod = sh.kubectl_json("get", "pods", "-n", ns, "-l", f"app.kubernetes.io/instance={release}")["items"][0]
    sa = pod["spec"]["serviceAccountName"]
    say(f"operator pod {pod['metadata']['name']} is Ready, running as ServiceAccount {ns}/{sa} (not cluster-admin)")


def display(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def default_example() -> Path:
    """The CPU sample of crds/examples/ (the one that asks for no GPU)."""
    examples = sorted((REPO / "crds/examples").glob("*.yaml"))
    cpu = [p for p in examples if "nvidia.com/gpu" not in p.read_text()]
    if not cpu:
        raise SystemExit(f"error: no CPU example job in {REPO / 'crds/examples'}; pass --job-file")
    return cpu[0]


def job_steps(job: dict[str, Any]) -> int | None:
    """The trainer's --steps from the job's container command/args, if it says."""
    for c in job["spec"]["template"]["spec"]["containers"]:
        argv = [str(a) for a in (c.get("command") or []) + (c.get("args") or [])]
        for i, a in enumerate(argv):
            if a == "--steps" and i + 1 < len(argv):
                return int(argv[i + 1])
            if a.startswith("--steps="):
                return int(a.split("=", 1)[1])
    return None


class Watcher:
    """Polls the job and its lighthouse; prints every change of conditions, group phases and quorum membership."""

    def __init__(self, sh: Shell, ns: str, job: str) -> None:
        self.sh, self.ns, self.job = sh, ns, job
        self.core, self.custom = sh.clients()
        self.timeline = Timeline(job)
        self.t_applied = time.monotonic()
        self.conditions: dict[str, tuple[str, str]] = {}
        self.groups: dict[int, tuple[str, int]] = {}
        self.quorum: list[str] | None = None
        self.token: str | None = None
        self.tls: ssl.SSLContext | None = None
        self.tls_enabled = True  # the job's spec.tls.enabled (read with the job)
        self.last_table = 0.0

    def t(self) -> float:
        return time.monotonic() - self.t_applied

    def poll(self) -> dict[str, Any] | None:
        try:
            obj = self.custom.get_namespaced_custom_object(
                contract.API_GROUP, contract.API_VERSION, self.ns, contract.PLURAL, self.job
            )
        except (ApiException, OSError) as e:
            say(f"(could not read the job: {e})")
            return None
        self.tls_enabled = ((obj.get("spec") or {}).get("tls") or {}).get("enabled", True)
        status = obj.get("status") or {}
        for c in status.get("conditions") or []:
            now = (c.get("status", ""), c.get("reason", ""))
            if self.conditions.get(c["type"]) != now:
                self.conditions[c["type"]] = now
                say(f"condition {c['type']}={now[0]} ({now[1]}): {c.get('message', '')}")
        for g in status.get("replicaGroups") or []:
            now = (g.get("phase", "?"), int(g.get("generation", 0)))
            if self.groups.get(g["index"]) != now:
                self.groups[g["index"]] = now
                role = " (spare)" if g.get("spare") else ""
                say(f"group {g['index']}: {now[0]}, generation {now[1]}{role}, restarts {g.get('restarts', 0)}")
        lh = self.lighthouse_status()
        if lh is not None:
            sample = self.timeline.add_status(self.t(), lh)
            if sample.quorum_groups != self.quorum:
                self.quorum = sample.quorum_groups
                say(f"quorum {lh.quorum_id}: groups {', '.join(self.quorum) or '-'} at step {sample.max_step}")
        if time.monotonic() - self.last_table > 15:
            self.table()
        return obj

    def table(self) -> None:
        self.last_table = time.monotonic()
        print(
            self.sh.run("kubectl", "get", "ftj", self.job, "-n", self.ns, "-o", "wide", echo=False, check=False),
            end="",
            flush=True,
        )

    def _secret(self, name: str, key: str) -> str | None:
        try:
            secret = self.core.read_namespaced_secret(name, self.ns)
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        raw = (secret.data or {}).get(key)
        return base64.b64decode(raw).decode() if raw else None

    def lighthouse_status(self) -> StatusResponse | None:
        """GET /v1/status from the lighthouse pod (pod IPs are reachable from this host), with the job's token; for
        a TLS job (the default) verified, as the operator does, against the job's CA and the Service's name."""
        try:
            if self.token is None:
                self.token = self._secret(names.token_secret(self.job), contract.TOKEN_SECRET_KEY)
            if self.tls is None and self.tls_enabled:  # the operator creates it just after the token's
                ca = self._secret(names.tls_secret(self.job), pki.CA_CERT)
                self.tls = client_context(ca_data=ca) if ca else None
            selector = f"{contract.LABEL_JOB}={self.job},{contract.LABEL_ROLE}={contract.ROLE_LIGHTHOUSE}"
            pods = self.core.list_namespaced_pod(self.ns, label_selector=selector).items
        except (ApiException, OSError):
            return None  # not created yet
        ips = [p.status.pod_ip for p in pods if p.status.phase == "Running" and p.status.pod_ip]
        if not self.token or not ips or (self.tls_enabled and self.tls is None):
            return None
        if self.tls is None:
            conn = http.client.HTTPConnection(ips[0], contract.LIGHTHOUSE_PORT, timeout=2)
        else:
            server_name = names.lighthouse_dns_names(self.job, self.ns)[0]
            conn = NamedHTTPSConnection(ips[0], contract.LIGHTHOUSE_PORT, context=self.tls, server_name=server_name,
                                        timeout=2)  # fmt: skip
        try:
            conn.request("GET", contract.PATH_STATUS, headers={"Authorization": f"Bearer {self.token}"})
            resp = conn.getresponse()
            body = resp.read()
            return StatusResponse.model_validate_json(body) if resp.status == 200 else None
        except (OSError, ValueError, http.client.HTTPException):
            return None  # between lighthouse restarts: the job status still tells the story
        finally:
            conn.close()


def is_true(obj: dict[str, Any] | None, cond: str) -> bool:
    return any(
        c["type"] == cond and c.get("status") == "True"
        for c in ((obj or {}).get("status") or {}).get("conditions") or []
    )


def show_pods(sh: Shell, ns: str, job: str) -> None:
    """The pods are real containers: their logs, and a look inside the operator's (non-root, read-only root)."""
    sel = f"{contract.LABEL_JOB}={job},{contract.LABEL_ROLE}={contract.ROLE_WORKER},{contract.LABEL_GROUP}=0"
    worker = (sh.kubectl_json("get", "pods", "-n", ns, "-l", sel) or {}).get("items", [])
    if worker:
        say("the last lines a trainer container wrote (kubectl logs):")
        print(sh.run("kubectl", "logs", "-n", ns, worker[-1]["metadata"]["name"], "--tail=3", check=False), end="")
    op = (sh.kubectl_json("get", "pods", "-n", ns, "-l", "app.kubernetes.io/name=ftjob-operator") or {}).get("items")
    if op:
        say("inside the operator's container (kubectl exec): its user, and a write to its root filesystem")
        out = sh.run("kubectl", "exec", "-n", ns, op[0]["metadata"]["name"], "--", "sh", "-c", "id; touch /probe 2>&1",
                     check=False)  # fmt: skip
        print(out, end="")


def run_job(
    sh: Shell, ns: str, job_file: Path, kill_group: int, kill_fraction: float, timeout_s: float, out: Path
) -> int:
    job = yaml.safe_load(job_file.read_text())
    name = job["metadata"]["name"]
    steps = job_steps(job) or 100
    kill_at = max(1, int(steps * kill_fraction))
    say(
        f"applying the sample job {name} from {display(job_file)} ({steps} steps; group {kill_group} "
        f"will be killed once step {kill_at} is committed)"
    )
    images = ", ".join(sorted({c["image"] for c in job["spec"]["template"]["spec"]["containers"]}))
    say(f"(its containers run {images}: hack/cluster tags its build of this checkout so in every node)")
    sh.run("kubectl", "apply", "-n", ns, "-f", str(job_file))  # as written, no image rewritten
    w = Watcher(sh, ns, name)
    killed_at: float | None = None
    killed_step = 0
    killed_incarnation: str | None = None
    dropped_at: float | None = None
    recovered = False
    obj: dict[str, Any] | None = None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        obj = w.poll()
        last = w.timeline.samples[-1] if w.timeline.samples else None
        g = str(kill_group)
        if killed_at is None and last and last.max_step >= kill_at and g in last.groups and g in last.quorum_groups:
            killed_incarnation = last.groups[g].incarnation
            say(f"killing replica group {g} at committed step {last.max_step} (deleting all of its pods)")
            sel = f"{contract.LABEL_JOB}={name},{contract.LABEL_GROUP}={g},{contract.LABEL_ROLE}={contract.ROLE_WORKER}"
            sh.run("kubectl", "delete", "pod", "-n", ns, "-l", sel, "--wait=false")
            killed_at, killed_step = w.t(), last.max_step
            w.table()
        if killed_at is not None and dropped_at is None and killed_incarnation is not None:
            dropped_at = w.timeline.dropped_out(g, killed_incarnation, killed_at)
            if dropped_at is not None:  # one mark for the failure, where the lighthouse lost the group
                w.timeline.mark(dropped_at, "kill", f"group {g} out (killed at step {killed_step})")
                say(f"group {g} dropped out of the lighthouse {dropped_at - killed_at:.1f}s after the kill")
        if killed_at is not None and not recovered and last:
            m = last.groups.get(g)
            if m and m.incarnation != killed_incarnation and m.contributing and g in last.quorum_groups:
                recovered = True
                w.timeline.mark(w.t(), "recovered", f"group {g} back ({w.t() - killed_at:.1f}s)")
                say(
                    f"group {g} is back in the quorum and contributing, {w.t() - killed_at:.1f}s after the kill "
                    f"(the others never stopped: committed step {last.max_step})"
                )
        if is_true(obj, "Succeeded") or is_true(obj, "Failed"):
            break
        time.sleep(0.5)  # the demo's poll period
    w.table()
    if killed_at is not None and dropped_at is None:  # the lighthouse never showed it leave: mark the kill itself
        w.timeline.mark(killed_at, "kill", f"group {kill_group} killed at step {killed_step}")
    ok = is_true(obj, "Succeeded")
    w.timeline.mark(w.t(), "succeeded" if ok else "failed", "Succeeded" if ok else "not Succeeded")
    png, samples_png, raw = out / "timeline.png", out / "lighthouse-samples.png", out / "timeline.json"
    w.timeline.save_json(raw)
    killed = f"group {kill_group} killed at step {killed_step}" if killed_at is not None else "nothing killed"
    title = f"ftjob demo: job {name}, {killed}" + (" — Succeeded" if ok else " — did not succeed")
    plot(w.timeline, samples_png, title)  # the demo's own 0.5 s lighthouse samples
    if plugin_timeline(sh, ns, name, png):
        say(f"the timeline is in {png}; the demo's lighthouse samples in {samples_png} ({raw})")
    else:
        png.write_bytes(samples_png.read_bytes())
        say(f"the timeline (from the demo's lighthouse samples) is in {png} (samples in {raw})")
    print(sh.run("kubectl", "describe", "ftj", name, "-n", ns, echo=False, check=False).split("Events:")[-1][:3000])
    say("the job at a glance, as the kubectl plugin shows it:")
    print(kubectl_ftjob(sh, "-n", ns, "status", name).stdout, flush=True)
    if not ok:
        say(f"job {name} did not succeed within {timeout_s:.0f}s; see `kubectl describe ftj {name} -n {ns}`")
        return 1
    if killed_at is None:
        say("warning: the job finished before the kill point; nothing was killed")
    show_pods(sh, ns, name)
    say(f"job {name} Succeeded; whole demo took {time.monotonic() - T0:.0f}s")
    return 0


def kubectl_ftjob(sh: Shell, *args: str) -> subprocess.CompletedProcess[str]:
    """The kubectl plugin (`kubectl ftjob ...` once the venv's kubectl-ftjob is on PATH), echoed like kubectl."""
    script = Path(sys.executable).with_name("kubectl-ftjob")
    argv = [str(script)] if script.exists() else [sys.executable, "-m", "ftjob.operator.kubectl.cli"]
    print(f"  $ kubectl ftjob {shlex.join(args)}", flush=True)
    return subprocess.run([*argv, *args], capture_output=True, text=True, env=sh.env)


def plugin_timeline(sh: Shell, ns: str, job: str, png: Path) -> bool:
    """`kubectl ftjob timeline` draws the PNG from the job's status history and Events."""
    say("drawing the job's timeline with the kubectl plugin")
    proc = kubectl_ftjob(sh, "-n", ns, "timeline", job, "-o", str(png))
    if proc.returncode != 0:
        say(f"kubectl ftjob timeline failed ({proc.returncode}): {(proc.stderr or proc.stdout).strip()[-300:]}")
    return proc.returncode == 0


def main() -> int:
    p = argparse.ArgumentParser(prog="hack/demo", description=__doc__.splitlines()[0])
    p.add_argument("--namespace", default="ftjob-demo", help="namespace for the operator and the job")
    p.add_argument("--release", default="ftjob-demo", help="Helm release name")
    p.add_argument("--job-file", type=Path, help="job manifest (default: the CPU sample in crds/examples/)")
    p.add_argument("--kill-group", type=int, default=1, help="replica group to kill (default 1)")
    p.add_argument("--kill-at", type=float, default=0.3, help="kill once this fraction of the steps is committed")
    p.add_argument("--timeout", type=float, default=900, help="seconds to wait for the job to succeed")
    p.add_argument("--out", type=Path, default=REPO / "out" / "demo", help="where the PNG and samples go")
    p.add_argument("--cleanup", action="store_true", help="uninstall and delete the namespace at the end")
    args = p.parse_args()
    if not 0 < args.kill_at < 1:
        p.error("--kill-at is a fraction of the steps: between 0 and 1 (e.g. 0.3)")
    job_file = (args.job_file or default_example()).resolve()
    cluster_up()
    sh = Shell()
    install_operator(sh, args.namespace, args.release)
    code = run_job(sh, args.namespace, job_file, args.kill_group, args.kill_at, args.timeout, args.out)
    if args.cleanup:
        sh.run("helm", "uninstall", args.release, "-n", args.namespace, "--wait")
        sh.run("kubectl", "delete", "namespace", args.namespace, "--wait=false")
    else:
        say(
            f"left running for a look: `kubectl get ftj,pods -n {args.namespace}`; remove with "
            f"`helm uninstall {args.release} -n {args.namespace} && kubectl delete ns {args.namespace}`"
        )
    return code


if __name__ == "__main__":
    sys.exit(main())
