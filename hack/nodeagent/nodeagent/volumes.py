"""Pod volumes materialised as host directories, later bind-mounted at each container's mountPath.

Supported: secret, configMap (items, defaultMode, optional), emptyDir, downwardAPI, projected (serviceAccountToken via
the TokenRequest API, configMap, secret, downwardAPI), hostPath, and persistentVolumeClaim (a directory
`<pvc_root>/<namespace>/<claim>` shared by every node, like an NFS volume).
"""

from __future__ import annotations

import base64
import os
import time
from dataclasses import dataclass
from pathlib import Path

from .envvars import ConfigMissingError, field_ref, resource_field
from .kubeapi import ApiError, KubeClient


class ObjectSource:
    """Reads Secrets/ConfigMaps (the node authorizer lets a node read those its pods reference) and SA tokens."""

    def __init__(self, client: KubeClient) -> None:
        self.client = client

    async def data(self, kind: str, ns: str, name: str) -> dict[str, bytes] | None:
        plural = "secrets" if kind == "secret" else "configmaps"
        try:
            obj = await self.client.get(f"/api/v1/namespaces/{ns}/{plural}/{name}")
        except ApiError as e:
            if e.status in (403, 404):  # the node authorizer answers 403 for objects it cannot link to our pods
                return None
            raise
        if kind == "secret":
            return {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
        out = {k: v.encode() for k, v in (obj.get("data") or {}).items()}
        out.update({k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()})
        return out

    async def text_data(self, kind: str, ns: str, name: str) -> dict[str, str] | None:
        data = await self.data(kind, ns, name)
        return None if data is None else {k: v.decode(errors="replace") for k, v in data.items()}

    async def token(self, pod: dict, audience: str | None, expiration_s: int) -> tuple[str, float]:
        """A pod-bound service account token and the time it should be refreshed."""
        meta, spec = pod["metadata"], pod.get("spec", {})
        sa = spec.get("serviceAccountName") or "default"
        body = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {
                "audiences": [audience] if audience else None,
                "expirationSeconds": expiration_s,
                "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": meta["name"], "uid": meta["uid"]},
            },
        }
        if not audience:
            del body["spec"]["audiences"]
        resp = await self.client.post(f"/api/v1/namespaces/{meta['namespace']}/serviceaccounts/{sa}/token", body)
        return resp["status"]["token"], time.time() + 0.8 * expiration_s


@dataclass(frozen=True)
class Mount:
    source: Path
    target: str
    read_only: bool


def _write(path: Path, content: bytes, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(content)
    tmp.chmod(mode)
    os.replace(tmp, path)  # the directory is bind-mounted, not the file: a rename is seen by the containers


def _select_items(data: dict[str, bytes], items: list | None, default_mode: int, what: str) -> dict[str, tuple]:
    if not items:
        return {k: (v, default_mode) for k, v in data.items()}
    out = {}
    for item in items:
        if item["key"] not in data:
            raise ConfigMissingError(f"{what}: key {item['key']!r} not found")
        out[item.get("path", item["key"])] = (data[item["key"]], item.get("mode", default_mode))
    return out


class VolumeBuilder:
    """Builds one pod's volumes under <pod dir>/volumes and keeps projected tokens fresh."""

    def __init__(self, source: ObjectSource, pod_dir: Path, pvc_root: Path, node_ip: str) -> None:
        self.source = source
        self.root = pod_dir / "volumes"
        self.pvc_root = pvc_root
        self.node_ip = node_ip
        self.refresh_at: float = float("inf")  # earliest token refresh time

    async def _downward(self, pod: dict, items: list, target: Path, default_mode: int) -> None:
        for item in items:
            if "fieldRef" in item:
                value = field_ref(pod, item["fieldRef"]["fieldPath"], self.node_ip)
            else:
                name = item["resourceFieldRef"].get("containerName")
                container = next((c for c in pod["spec"]["containers"] if c["name"] == name), {})
                value = resource_field(container, item["resourceFieldRef"], "0", "0")
            _write(target / item["path"], value.encode(), item.get("mode", default_mode))

    async def _configish(self, pod: dict, kind: str, ref: dict, target: Path, default_mode: int) -> None:
        ns = pod["metadata"]["namespace"]
        name = ref.get("secretName") or ref.get("name", "")
        data = await self.source.data(kind, ns, name)
        if data is None:
            if ref.get("optional"):
                return
            raise ConfigMissingError(f"{kind} {ns}/{name} not found (or not referenced by this pod)")
        for rel, (content, mode) in _select_items(data, ref.get("items"), default_mode, f"{kind} {name}").items():
            _write(target / rel, content, mode)

    async def _projected(self, pod: dict, vol: dict, target: Path) -> None:
        default_mode = vol.get("defaultMode", 0o644)
        for src in vol.get("sources") or []:
            if "serviceAccountToken" in src:
                tok = src["serviceAccountToken"]
                token, refresh = await self.source.token(pod, tok.get("audience"), tok.get("expirationSeconds", 3607))
                self.refresh_at = min(self.refresh_at, refresh)
                _write(target / tok["path"], token.encode(), default_mode)
            elif "configMap" in src:
                await self._configish(pod, "configmap", src["configMap"], target, default_mode)
            elif "secret" in src:
                await self._configish(pod, "secret", src["secret"], target, default_mode)
            elif "downwardAPI" in src:
                await self._downward(pod, src["downwardAPI"].get("items") or [], target, default_mode)

    async def build(self, pod: dict) -> dict[str, Path]:
        """Materialises every volume; returns volume name -> host directory (or file, for hostPath)."""
        out: dict[str, Path] = {}
        self.refresh_at = float("inf")
        for vol in pod.get("spec", {}).get("volumes") or []:
            name = vol["name"]
            target = self.root / name
            if "hostPath" in vol:
                path = Path(vol["hostPath"]["path"])
                if vol["hostPath"].get("type", "") in ("", "DirectoryOrCreate") and not path.exists():
                    path.mkdir(parents=True, exist_ok=True)
                out[name] = path
                continue
            if "persistentVolumeClaim" in vol:
                path = self.pvc_root / pod["metadata"]["namespace"] / vol["persistentVolumeClaim"]["claimName"]
                path.mkdir(parents=True, exist_ok=True)
                out[name] = path
                continue
            target.mkdir(parents=True, exist_ok=True)
            out[name] = target
            if "emptyDir" in vol:
                continue
            if "secret" in vol:
                await self._configish(pod, "secret", vol["secret"], target, vol["secret"].get("defaultMode", 0o644))
            elif "configMap" in vol:
                cm = vol["configMap"]
                await self._configish(pod, "configmap", cm, target, cm.get("defaultMode", 0o644))
            elif "downwardAPI" in vol:
                dapi = vol["downwardAPI"]
                await self._downward(pod, dapi.get("items") or [], target, dapi.get("defaultMode", 0o644))
            elif "projected" in vol:
                await self._projected(pod, vol["projected"], target)
            else:
                kinds = sorted(k for k in vol if k != "name")
                raise ConfigMissingError(f"volume {name!r}: type {kinds} is not supported by this node agent")
        return out


def container_mounts(container: dict, volumes: dict[str, Path]) -> list[Mount]:
    mounts = []
    for vm in container.get("volumeMounts") or []:
        if vm["name"] not in volumes:
            raise ConfigMissingError(f"volumeMount {vm['mountPath']!r} names unknown volume {vm['name']!r}")
        source = volumes[vm["name"]]
        if vm.get("subPath"):
            source = source / vm["subPath"]
            if not source.exists():
                source.mkdir(parents=True, exist_ok=True)
        mounts.append(Mount(source, vm["mountPath"], bool(vm.get("readOnly"))))
    return mounts
