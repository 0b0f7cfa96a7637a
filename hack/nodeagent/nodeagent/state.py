"""The per-pod record on disk (<state_dir>/pods/<uid>/pod.json), read back after an agent restart.

hack/cluster reads it too: `host_veth` for cut-pod/heal-pod and `pids` for kill-node.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class ContainerRecord:
    pid: int
    start_time: int | None
    restart_count: int
    is_init: bool = False


@dataclass
class PodRecord:
    namespace: str
    name: str
    uid: str
    netns: str
    host_veth: str
    ip: str
    pids: list[int] = field(default_factory=list)
    containers: dict[str, ContainerRecord] = field(default_factory=dict)
    phase: str = "Pending"
    node: str = ""

    def save(self, pod_dir: Path) -> None:
        pod_dir.mkdir(parents=True, exist_ok=True)
        self.pids = sorted(c.pid for c in self.containers.values() if c.pid)
        tmp = pod_dir / ".pod.json.tmp"
        tmp.write_text(json.dumps(asdict(self), indent=1), encoding="utf-8")
        os.replace(tmp, pod_dir / "pod.json")

    @classmethod
    def load(cls, pod_dir: Path) -> PodRecord | None:
        try:
            raw = json.loads((pod_dir / "pod.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        containers = {k: ContainerRecord(**v) for k, v in (raw.pop("containers", None) or {}).items()}
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in raw.items() if k in known}, containers=containers)
