"""Container environment: env (value / valueFrom), envFrom, and the variables every pod gets."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable

from .commands import expand_refs

# Fetches a Secret's or ConfigMap's string data: (kind, namespace, name) -> {key: value}, or None when missing.
Fetcher = Callable[[str, str, str], Awaitable[dict[str, str] | None]]

_LABEL_REF = re.compile(r"^metadata\.(labels|annotations)\['(.+)'\]$")


class ConfigMissingError(ValueError):
    """A referenced Secret/ConfigMap/key is missing: the container waits with CreateContainerConfigError."""


def field_ref(pod: dict, path: str, node_ip: str) -> str:
    meta, spec, status = pod["metadata"], pod.get("spec", {}), pod.get("status", {})
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.hostIP": status.get("hostIP") or node_ip,
        "status.podIP": status.get("podIP", ""),
        "status.podIPs": ",".join(i["ip"] for i in status.get("podIPs") or []) or status.get("podIP", ""),
    }
    if path in simple:
        return simple[path]
    m = _LABEL_REF.match(path)
    if m:
        return (meta.get(m.group(1)) or {}).get(m.group(2), "")
    if path == "metadata.labels":
        return "\n".join(f'{k}="{v}"' for k, v in sorted((meta.get("labels") or {}).items()))
    if path == "metadata.annotations":
        return "\n".join(f'{k}="{v}"' for k, v in sorted((meta.get("annotations") or {}).items()))
    raise ConfigMissingError(f"fieldRef {path!r} is not supported by this node agent")


_UNITS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "m": 0.001}


def _quantity(text: str) -> float:
    m = re.match(r"^([0-9.]+)([A-Za-z]*)$", str(text))
    if not m or m.group(2) not in _UNITS:
        return 0.0
    return float(m.group(1)) * _UNITS[m.group(2)]


def resource_field(container: dict, ref: dict, node_cpu: str, node_memory: str) -> str:
    resource = ref.get("resource", "")
    kind, _, name = resource.partition(".")
    value = (container.get("resources", {}).get(kind) or {}).get(name)
    if value is None and kind == "limits":
        value = node_cpu if name == "cpu" else node_memory if name == "memory" else None
    if value is None:
        return "0"
    divisor = _quantity(ref.get("divisor", "1") or "1") or 1.0
    amount = _quantity(value) / divisor
    return str(int(-(-amount // 1)))  # Kubernetes rounds up


async def _lookup(fetch: Fetcher, kind: str, ns: str, ref: dict, what: str) -> dict[str, str] | None:
    data = await fetch(kind, ns, ref.get("name", ""))
    if data is None and not ref.get("optional"):
        raise ConfigMissingError(f"{what}: {kind} {ns}/{ref.get('name')} not found")
    return data


async def container_env(
    pod: dict,
    container: dict,
    fetch: Fetcher,
    *,
    base: dict[str, str],
    node_ip: str,
    node_cpu: str = "16",
    node_memory: str = "64Gi",
) -> dict[str, str]:
    """The env a container starts with: base vars, then envFrom, then env (later entries win, as in Kubernetes)."""
    ns = pod["metadata"].get("namespace", "")
    env = dict(base)
    for source in container.get("envFrom") or []:
        prefix = source.get("prefix", "")
        for kind, key in (("secret", "secretRef"), ("configmap", "configMapRef")):
            if key in source:
                data = await _lookup(fetch, kind, ns, source[key], f"envFrom {key}")
                for k, v in (data or {}).items():
                    env[prefix + k] = v
    for var in container.get("env") or []:
        name = var["name"]
        if "valueFrom" not in var:
            env[name] = expand_refs(str(var.get("value", "")), env)
            continue
        source = var["valueFrom"]
        if "fieldRef" in source:
            env[name] = field_ref(pod, source["fieldRef"]["fieldPath"], node_ip)
        elif "resourceFieldRef" in source:
            env[name] = resource_field(container, source["resourceFieldRef"], node_cpu, node_memory)
        else:
            kind, key = ("secret", "secretKeyRef") if "secretKeyRef" in source else ("configmap", "configMapKeyRef")
            ref = source.get(key)
            if ref is None:
                raise ConfigMissingError(f"env {name}: unsupported valueFrom {sorted(source)}")
            data = await _lookup(fetch, kind, ns, ref, f"env {name}")
            if data is None:
                continue
            if ref["key"] not in data:
                if ref.get("optional"):
                    continue
                raise ConfigMissingError(f"env {name}: key {ref['key']!r} not in {kind} {ns}/{ref.get('name')}")
            env[name] = data[ref["key"]]
    return env
