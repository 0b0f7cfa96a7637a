"""One container's life: start, watch, probe, restart with back-off, stop; and its containerStatus."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from .background import background
from .commands import NoCommandError
from .envvars import ConfigMissingError
from .probes import ProbeLoop
from .process import ContainerProcess, StartError, spawn, stop_group
from .timeutil import now_rfc3339
from .volumes import Mount

log = logging.getLogger("nodeagent.container")

# A backed-off container that then ran this long is healthy again: its back-off resets (kubelet uses 10 minutes).
BACKOFF_RESET_S = 600.0


@dataclass
class LaunchSpec:
    """Everything needed to start the container once, resolved from the pod by the pod worker."""

    argv: list[str]
    env: dict[str, str]
    mounts: list[Mount]
    working_dir: str


@dataclass
class RestartPolicy:
    policy: str  # Always / OnFailure / Never
    backoff_base_s: float
    backoff_max_s: float

    def restarts(self, exit_code: int | None, is_init: bool) -> bool:
        if is_init:
            return exit_code != 0 and self.policy != "Never"
        if self.policy == "Always":
            return True
        return self.policy == "OnFailure" and exit_code != 0


@dataclass
class ContainerState:
    state: dict = field(default_factory=lambda: {"waiting": {"reason": "ContainerCreating"}})
    last_state: dict = field(default_factory=dict)
    restart_count: int = 0
    ready: bool = False
    started: bool = False
    container_id: str = ""


def _state_obj(state: dict) -> dict:
    # Strategic merge patch merges maps: name all three keys so an old state is removed, not merged into.
    return {k: state.get(k) for k in ("waiting", "running", "terminated")}


class ContainerRunner:
    def __init__(
        self,
        spec: dict,
        *,
        is_init: bool,
        netns: str,
        log_dir: Path,
        policy: RestartPolicy,
        resolve: Callable[[dict], Awaitable[LaunchSpec]],
        on_change: Callable[[], None],
        on_started: Callable[[], None],
        pod_ip: str,
        grace_s: float,
    ) -> None:
        self.spec = spec
        self.name: str = spec["name"]
        self.is_init = is_init
        self.netns = netns
        self.log_dir = log_dir
        self.policy = policy
        self.resolve = resolve
        self.on_change = on_change
        self.on_started = on_started
        self.pod_ip = pod_ip
        self.grace_s = grace_s
        self.s = ContainerState()
        self.proc: ContainerProcess | None = None
        self.launch: LaunchSpec | None = None
        self.final_exit: int | None = None  # set when the container is done for good
        self.done = asyncio.Event()
        self._stopping = False
        self._wake = asyncio.Event()
        self._probe_tasks: list[asyncio.Task] = []
        self._liveness_failed = False
        self._lost = False

    # --- status -----------------------------------------------------------------------------------------------
    def status(self) -> dict:
        image = self.spec.get("image", "")
        out = {
            "name": self.name,
            "state": _state_obj(self.s.state),
            "lastState": _state_obj(self.s.last_state) if self.s.last_state else {},
            "ready": self.s.ready,
            "restartCount": self.s.restart_count,
            "image": image,
            "imageID": f"ftjob://{image}",
            "started": self.s.started and "running" in self.s.state,
        }
        if self.s.container_id:
            out["containerID"] = self.s.container_id
        return out

    def log_path(self, restart: int | None = None) -> Path:
        return self.log_dir / self.name / f"{self.s.restart_count if restart is None else restart}.log"

    def _set(self, **changes: object) -> None:
        for k, v in changes.items():
            setattr(self.s, k, v)
        self.on_change()

    # --- life -------------------------------------------------------------------------------------------------
    async def _sleep_unless_stopped(self, seconds: float) -> None:
        self._wake.clear()
        try:
            await asyncio.wait_for(self._wake.wait(), timeout=seconds)
        except TimeoutError:
            pass

    async def _start(self) -> ContainerProcess | None:
        """Starts the process, or records why it cannot run (then returns None)."""
        while not self._stopping:
            try:
                self.launch = await self.resolve(self.spec)
                break
            except ConfigMissingError as e:
                self._set(state={"waiting": {"reason": "CreateContainerConfigError", "message": str(e)}})
                await self._sleep_unless_stopped(2.0)
            except NoCommandError as e:
                self._terminate_without_start(127, "NoCommand", str(e))
                return None
        if self._stopping or self.launch is None:
            return None
        try:
            proc = spawn(
                self.launch.argv,
                netns=self.netns,
                env=self.launch.env,
                mounts=self.launch.mounts,
                working_dir=self.launch.working_dir,
                log_path=self.log_path(),
            )
        except (StartError, OSError) as e:
            self._terminate_without_start(128, "ContainerCannotRun", str(e))
            return None
        return proc

    def _terminate_without_start(self, code: int, reason: str, message: str) -> None:
        stamp = now_rfc3339()
        term = {"exitCode": code, "reason": reason, "message": message, "startedAt": stamp, "finishedAt": stamp}
        self.log_path().parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path(), "a", encoding="utf-8") as f:
            f.write(f"ftjob node agent: {reason}: {message}\n")
        self._set(state={"terminated": term}, ready=False)

    def adopt(self, proc: ContainerProcess, restart_count: int, started_at: str) -> None:
        """Takes over a process that survived an agent restart."""
        self.proc = proc
        self.s.restart_count = restart_count
        self.s.container_id = f"ftjob://{proc.pid}"
        self.s.state = {"running": {"startedAt": started_at or now_rfc3339()}}
        self.s.started = True

    def lost(self, restart_count: int, started_at: str) -> None:
        """The recorded process ended while no agent watched it: report it and let the restart policy decide."""
        self.s.restart_count = restart_count
        self.s.state = {"running": {"startedAt": started_at or now_rfc3339()}}
        self._record_exit(None)
        self._lost = True

    async def run(self) -> None:
        failures = 0
        try:
            while True:
                if self._lost:
                    self._lost = False
                    code = None
                elif self.proc is None:
                    self.proc = await self._start()
                    if self.proc is None:
                        code = (self.s.state.get("terminated") or {}).get("exitCode")
                    else:
                        self.s.container_id = f"ftjob://{self.proc.pid}"
                        self._set(
                            state={"running": {"startedAt": now_rfc3339()}}, started=True, ready=self._initially_ready()
                        )
                        self.on_started()
                if self.proc is not None:
                    began = time.monotonic()
                    self._start_probes()
                    code = await self.proc.exit_code
                    self._stop_probes()
                    self.proc.signal_group(signal.SIGKILL)  # leftovers of the container die with it
                    self._record_exit(code)
                    if time.monotonic() - began > BACKOFF_RESET_S:
                        failures = 0
                    self.proc = None
                if self._stopping or not self.policy.restarts(code, self.is_init):
                    self.final_exit = code if code is not None else 137
                    return
                failures += 1
                delay = min(self.policy.backoff_max_s, self.policy.backoff_base_s * 2 ** (failures - 1))
                self.s.last_state = self.s.state
                message = f"back-off {delay:g}s restarting failed container {self.name}"
                self._set(state={"waiting": {"reason": "CrashLoopBackOff", "message": message}})
                await self._sleep_unless_stopped(delay)
                if self._stopping:
                    self.final_exit = code if code is not None else 137
                    return
                self.s.restart_count += 1
        finally:
            self._stop_probes()
            self.done.set()
            self.on_change()

    def _record_exit(self, code: int | None) -> None:
        started = (self.s.state.get("running") or {}).get("startedAt", now_rfc3339())
        if code is None:
            term = {
                "exitCode": 137,
                "reason": "ContainerStatusUnknown",
                "message": "the process ended while the node agent was restarting; its exit code is unknown",
            }
        else:
            reason = "Completed" if code == 0 else "Error"
            term = {"exitCode": code, "reason": reason}
            if self._liveness_failed:
                term["message"] = "killed after failing its liveness probe"
        term.update(startedAt=started, finishedAt=now_rfc3339(), containerID=self.s.container_id)
        self._liveness_failed = False
        self._set(state={"terminated": term}, ready=False)

    # --- probes -----------------------------------------------------------------------------------------------
    def _initially_ready(self) -> bool:
        return not self.is_init and "readinessProbe" not in self.spec

    def _start_probes(self) -> None:
        if self.is_init:
            return
        if "readinessProbe" in self.spec:
            loop = ProbeLoop(
                self.spec["readinessProbe"],
                self.spec,
                self.pod_ip,
                self._exec_probe,
                lambda ok: self._set(ready=ok),
                initial=False,
            )
            self._probe_tasks.append(asyncio.create_task(loop.run()))
        if "livenessProbe" in self.spec:
            loop = ProbeLoop(
                self.spec["livenessProbe"], self.spec, self.pod_ip, self._exec_probe, self._on_liveness, initial=True
            )
            self._probe_tasks.append(asyncio.create_task(loop.run()))

    def _stop_probes(self) -> None:
        for task in self._probe_tasks:
            task.cancel()
        self._probe_tasks.clear()

    def _on_liveness(self, ok: bool) -> None:
        if not ok and self.proc is not None:
            log.info("container %s failed its liveness probe: restarting it", self.name)
            self._liveness_failed = True
            grace = float(self.spec["livenessProbe"].get("terminationGracePeriodSeconds", self.grace_s))
            background(stop_group(self.proc, grace), name=f"liveness-kill {self.name}")

    async def _exec_probe(self, argv: list[str]) -> int:
        from .process import IP, SH, wrapper_script

        launch = self.launch
        if launch is None:
            return 1
        script = wrapper_script(launch.mounts, launch.working_dir)
        proc = await asyncio.create_subprocess_exec(
            IP,
            "netns",
            "exec",
            self.netns,
            SH,
            "-c",
            script,
            "sh",
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
            env=launch.env,
            start_new_session=True,
        )
        try:
            return await proc.wait()
        except asyncio.CancelledError:
            try:
                proc.kill()
            except ProcessLookupError:
                pass
            raise

    async def stop(self, grace_s: float) -> None:
        """Stops the container for good (pod deletion): no more restarts."""
        self._stopping = True
        self._wake.set()
        if self.proc is not None:
            await stop_group(self.proc, grace_s)
