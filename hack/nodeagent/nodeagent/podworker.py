"""One pod on this node: network, volumes, init containers then containers, status, and deletion like a kubelet."""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Callable

from .adoption import adopt_containers
from .background import background
from .commands import container_argv
from .container import ContainerRunner, LaunchSpec, RestartPolicy
from .context import NodeContext
from .envvars import container_env
from .kubeapi import ApiError
from .network import NETNS_RUN_DIR, PodNet, host_veth_name, netns_name, setup_pod_network, teardown_pod_network
from .podstatus import ConditionClock, PodFacts, build_pod_status
from .process import ContainerProcess, stop_group
from .state import ContainerRecord, PodRecord
from .timeutil import now_rfc3339
from .volumes import ConfigMissingError, VolumeBuilder, container_mounts

log = logging.getLogger("nodeagent.pod")


class UnsupportedPodError(ValueError):
    """The pod asks for something this agent cannot provide; it fails with a message saying what."""


SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class PodWorker:
    def __init__(self, ctx: NodeContext, pod: dict, record: PodRecord | None = None, finished: bool = False) -> None:
        self.ctx = ctx
        self.pod = pod
        meta = pod["metadata"]
        self.uid: str = meta["uid"]
        self.namespace: str = meta["namespace"]
        self.name: str = meta["name"]
        self.dir = ctx.config.pods_dir / self.uid
        self.spec: dict = pod.get("spec", {})
        self.policy = RestartPolicy(
            self.spec.get("restartPolicy", "Always"),
            ctx.config.restart_backoff_base_s,
            ctx.config.restart_backoff_max_s,
        )
        self.grace_s = float(self.spec.get("terminationGracePeriodSeconds", 30))
        self.record = record
        self.net: PodNet | None = None
        self.clock = ConditionClock()
        self.clock.seed(pod.get("status", {}).get("conditions") or [])
        self.start_time: str = pod.get("status", {}).get("startTime") or now_rfc3339()
        self.init_runners: list[ContainerRunner] = []
        self.runners: list[ContainerRunner] = []
        self.volumes: dict | None = None
        self.volume_builder = VolumeBuilder(ctx.objects, self.dir, ctx.config.pvc_dir, ctx.config.node_ip)
        self.init_failed = False
        self.initialized = False
        self.network_ready = False
        self.message = ""
        self.finished = finished  # terminal: processes gone, logs kept until the pod is deleted
        self.deleting = False
        self.task: asyncio.Task | None = None
        self._delete_task: asyncio.Task | None = None
        self._gone = False  # deleted: no more status updates
        self._refresher: asyncio.Task | None = None
        self._ended = 0  # containers terminated in the last pushed status
        self._was_ready = False

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def ip(self) -> str:
        return self.net.ip if self.net else (self.pod.get("status", {}).get("podIP") or "")

    # --- setup ------------------------------------------------------------------------------------------------
    def start(self) -> None:
        self.task = asyncio.create_task(self._run(), name=f"pod {self.key}")

    async def _setup_network(self) -> None:
        cfg = self.ctx.config
        rec = self.record
        if rec and rec.netns and (NETNS_RUN_DIR / rec.netns).exists():
            self.net = PodNet(rec.netns, rec.host_veth, rec.ip)  # adopted: keep the pod's address
            self.ctx.ips.reserve(rec.ip)
        else:
            ip = self.ctx.ips.allocate()
            self.net = PodNet(netns_name(cfg.pod_netns_prefix, self.uid), host_veth_name(self.uid), ip)
            async with self.ctx.setup_slots:
                for attempt in range(3):
                    try:
                        await setup_pod_network(self.net, self.ctx.ips.prefixlen, cfg.pod_gateway, cfg.pod_bridge)
                        break
                    except Exception as e:
                        if attempt == 2:
                            raise
                        log.warning("pod %s: network setup failed (%s); retrying", self.key, e)
            self.record = PodRecord(
                self.namespace, self.name, self.uid, self.net.netns, self.net.host_veth, self.net.ip, node=cfg.node_name
            )
        assert self.record is not None
        self.record.save(self.dir)
        self.ctx.dns.add_pod(self.net.netns, self.pod, self.net.ip)
        self.network_ready = True

    def _runner(self, spec: dict, is_init: bool) -> ContainerRunner:
        assert self.net is not None
        return ContainerRunner(
            spec,
            is_init=is_init,
            netns=self.net.netns,
            log_dir=self.dir / "logs",
            policy=self.policy,
            resolve=self._resolve,
            on_change=self.push_status,
            on_started=self._save_pids,
            pod_ip=self.net.ip,
            grace_s=self.grace_s,
        )

    def _pod_view(self) -> dict:
        """The pod as the downward API should see it (our IP is not in the API object yet)."""
        status = {
            **self.pod.get("status", {}),
            "podIP": self.ip,
            "podIPs": [{"ip": self.ip}],
            "hostIP": self.ctx.config.node_ip,
        }
        return {**self.pod, "status": status}

    async def _resolve(self, spec: dict) -> LaunchSpec:
        cfg = self.ctx.config
        base = {
            "PATH": f"{cfg.venv}/bin:{SYSTEM_PATH}",
            "HOME": "/root",
            "LANG": "C.UTF-8",
            "HOSTNAME": self.spec.get("hostname") or self.name,
            "KUBERNETES_SERVICE_HOST": cfg.kubernetes_service_host,
            "KUBERNETES_SERVICE_PORT": str(cfg.kubernetes_service_port),
            "KUBERNETES_SERVICE_PORT_HTTPS": str(cfg.kubernetes_service_port),
        }
        env = await container_env(
            self._pod_view(),
            spec,
            self.ctx.objects.text_data,
            base=base,
            node_ip=cfg.node_ip,
            node_cpu=cfg.cpu,
            node_memory=cfg.memory,
        )
        argv = container_argv(spec, env)
        mounts = container_mounts(spec, self.volumes or {})
        return LaunchSpec(argv, env, mounts, spec.get("workingDir") or "/")

    async def _build_volumes(self) -> None:
        while not self.deleting:
            try:
                self.volumes = await self.volume_builder.build(self._pod_view())
                self.message = ""
                return
            except ConfigMissingError as e:
                self._all_waiting("ContainerCreating", f"FailedMount: {e}")
            except ApiError as e:
                self._all_waiting("ContainerCreating", f"FailedMount: {e}")
            await asyncio.sleep(2.0)

    def _all_waiting(self, reason: str, message: str) -> None:
        self.message = message
        for r in [*self.init_runners, *self.runners]:
            if "waiting" in r.s.state:
                r.s.state = {"waiting": {"reason": reason, "message": message}}
        self.push_status()

    def _save_pids(self) -> None:
        if self.record is None:
            return
        for r in [*self.init_runners, *self.runners]:
            if r.proc is not None:
                self.record.containers[r.name] = ContainerRecord(
                    r.proc.pid, r.proc.start_time, r.s.restart_count, r.is_init
                )
        self.record.save(self.dir)

    # --- life -------------------------------------------------------------------------------------------------
    async def _run(self) -> None:
        try:
            if self.spec.get("hostNetwork"):
                raise UnsupportedPodError(
                    "hostNetwork pods are not supported by the ftjob node agent: drop hostNetwork"
                )
            await self._setup_network()
            if self.deleting:
                return
            self.init_runners = [self._runner(c, True) for c in self.spec.get("initContainers") or []]
            self.runners = [self._runner(c, False) for c in self.spec.get("containers") or []]
            past_init = False
            if self.record and self.record.containers:
                past_init = adopt_containers(self.init_runners, self.runners, self.record, self.pod.get("status", {}))
            self.push_status()
            await self._build_volumes()
            if self.volume_builder.refresh_at != float("inf"):
                self._refresher = background(self._refresh_tokens(), name=f"tokens {self.key}")
            for r in self.runners:
                if r.proc is not None:
                    try:
                        r.launch = await self._resolve(r.spec)  # exec probes of adopted containers need it
                    except Exception as e:
                        log.warning("pod %s: cannot rebuild launch spec of %s: %s", self.key, r.name, e)
            if not past_init:
                for r in self.init_runners:
                    if self.deleting:
                        return
                    await r.run()
                    if r.final_exit != 0:
                        self.init_failed = True
                        break
            self.initialized = not self.init_failed
            self.push_status()
            if not self.init_failed and not self.deleting:
                await asyncio.gather(*(r.run() for r in self.runners))
            if not self.deleting:
                await self._finish()
        except asyncio.CancelledError:
            raise
        except UnsupportedPodError as e:
            log.warning("pod %s: %s", self.key, e)
            self.message = str(e)
            self.init_failed = True
            self.push_status()
        except Exception as e:
            log.exception("pod %s: setup failed", self.key)
            self.message = f"node agent could not start the pod: {e}"
            self.init_failed = True
            self.push_status()

    async def _refresh_tokens(self) -> None:
        """Rewrites the volumes (new service account tokens) when 80% of a token's lifetime has passed."""
        while not self.deleting and not self.finished:
            await asyncio.sleep(max(1.0, self.volume_builder.refresh_at - time.time()))
            try:
                self.volumes = await self.volume_builder.build(self._pod_view())
            except Exception as e:
                log.warning("pod %s: refreshing projected tokens failed (%s); retrying in 60s", self.key, e)
                self.volume_builder.refresh_at = time.time() + 60

    async def _finish(self) -> None:
        """Terminal phase reached: free the network, keep the logs until the pod is deleted."""
        self.finished = True
        if self._refresher is not None:
            self._refresher.cancel()
        self.push_status()
        await self._teardown_network()
        if self.record:
            self.record.phase = self.status()["phase"]
            self.record.save(self.dir)
        log.info("pod %s finished: %s", self.key, self.status()["phase"])

    async def _teardown_network(self) -> None:
        if self.net is None and self.record is not None and self.record.netns:
            self.net = PodNet(self.record.netns, self.record.host_veth, self.record.ip)  # never adopted
        if self.net is None:
            return
        self.ctx.dns.remove_pod(self.net.netns)
        await teardown_pod_network(self.net)
        self.ctx.ips.release(self.net.ip)

    # --- status -----------------------------------------------------------------------------------------------
    def status(self) -> dict:
        return build_pod_status(
            PodFacts(
                init=[r.status() for r in self.init_runners],
                main=[r.status() for r in self.runners],
                # A pod being deleted never restarts again: it ends Succeeded or Failed, as a kubelet reports it.
                policy="Never" if self.deleting else self.policy.policy,
                init_failed=self.init_failed,
                initialized=self.initialized,
                network_ready=self.network_ready,
                node_ip=self.ctx.config.node_ip,
                pod_ip=self.ip,
                start_time=self.start_time,
                message=self.message,
            ),
            self.clock,
        )

    def push_status(self) -> None:
        if self._gone:
            return
        status = self.status()
        # Failure news goes first: a container that ended, or a pod that stopped being Ready.
        ended = sum(1 for c in status["containerStatuses"] if c["state"].get("terminated"))
        ready = any(c["type"] == "Ready" and c["status"] == "True" for c in status["conditions"])
        urgent = ended > self._ended or (self._was_ready and not ready)
        self._ended, self._was_ready = ended, ready
        self.ctx.status.submit(self.uid, self.namespace, self.name, status, urgent=urgent)

    # --- deletion ---------------------------------------------------------------------------------------------
    def request_delete(self, grace_s: float | None, object_gone: bool = False) -> bool:
        """Starts stopping and deleting the pod; False when that is already under way."""
        if self._delete_task is not None:
            return False
        self._delete_task = asyncio.create_task(self._delete(grace_s, object_gone), name=f"delete {self.key}")
        return True

    def on_deleted(self, callback: Callable[[], None]) -> None:
        assert self._delete_task is not None
        self._delete_task.add_done_callback(lambda _task: callback())

    async def _pre_stop(self, grace_s: float) -> None:
        hooks = [
            (r, r.spec["lifecycle"]["preStop"]["exec"]["command"])
            for r in self.runners
            if r.proc is not None and "exec" in ((r.spec.get("lifecycle") or {}).get("preStop") or {})
        ]
        if not hooks:
            return

        async def one(r: ContainerRunner, argv: list[str]) -> None:
            try:
                await asyncio.wait_for(r._exec_probe(list(argv)), timeout=grace_s)
            except (TimeoutError, OSError):
                pass

        await asyncio.gather(*(one(r, argv) for r, argv in hooks))

    async def _delete(self, grace_s: float | None, object_gone: bool) -> None:
        self.deleting = True
        if self._refresher is not None:
            self._refresher.cancel()
        grace = self.grace_s if grace_s is None else float(grace_s)
        log.info("pod %s: stopping (grace %.0fs)", self.key, grace)
        if not self.finished:
            await self._pre_stop(grace)
            await asyncio.gather(*(r.stop(grace) for r in [*self.init_runners, *self.runners]))
            if self.task is not None:
                try:
                    await asyncio.wait_for(asyncio.shield(self.task), timeout=5.0)
                except (TimeoutError, Exception):
                    self.task.cancel()
            # Runners the setup built meanwhile, and processes recorded before an agent restart that no runner has
            # adopted yet (the pod was deleted while the agent was down): they get the same SIGTERM and grace.
            await asyncio.gather(*(r.stop(grace) for r in [*self.init_runners, *self.runners]))
            await asyncio.gather(*(stop_group(p, grace) for p in self._unowned_processes()))
            await self._teardown_network()
        if not object_gone:
            await self._delete_object()
        self._gone = True
        self.ctx.status.forget(self.uid)
        shutil.rmtree(self.dir, ignore_errors=True)
        log.info("pod %s: deleted", self.key)

    def _unowned_processes(self) -> list[ContainerProcess]:
        if self.record is None:
            return []
        owned = {r.proc.pid for r in [*self.init_runners, *self.runners] if r.proc is not None}
        procs = [ContainerProcess(c.pid, c.start_time, None) for c in self.record.containers.values()]
        return [p for p in procs if p.pid not in owned and p.alive()]

    async def _delete_object(self) -> None:
        if not self.finished:
            try:
                await self.ctx.status.send_now(self.uid, self.namespace, self.name, self.status())
            except Exception as e:
                log.debug("final status of %s: %s", self.key, e)
        body = {
            "apiVersion": "v1",
            "kind": "DeleteOptions",
            "gracePeriodSeconds": 0,
            "preconditions": {"uid": self.uid},
        }
        for attempt in range(5):
            try:
                await self.ctx.client.delete(f"/api/v1/namespaces/{self.namespace}/pods/{self.name}", body)
                return
            except ApiError as e:
                if e.status in (404, 409):
                    return
                log.warning("pod %s: delete failed (%s), attempt %d", self.key, e, attempt + 1)
                await asyncio.sleep(0.5 * (attempt + 1))

    async def wait_deleted(self) -> None:
        if self._delete_task is not None:
            await self._delete_task
