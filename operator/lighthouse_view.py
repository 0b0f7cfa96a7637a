"""What the operator reads from a lighthouse's GET /v1/status, parsed tolerantly into plain data.

Kept apart from the HTTP client so status aggregation and the planner can use it in unit tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class LighthouseGroup:
    group: str
    step: int | None = None
    contributing: bool | None = None
    finished: bool = False
    param_digest: str | None = None
    in_quorum: bool | None = None


@dataclass(frozen=True)
class LighthouseView:
    quorum_id: int | None = None
    quorum_size: int | None = None
    step: int | None = None  # the committed step of the current quorum
    groups: dict[str, LighthouseGroup] = field(default_factory=dict)
    evicted: dict[str, str] = field(default_factory=dict)  # group -> reason of its latest drop (recent history)

    @property
    def finished_groups(self) -> set[int]:
        return {int(g) for g, v in self.groups.items() if v.finished and g.isdigit()}

    @classmethod
    def parse(cls, body: dict[str, Any]) -> LighthouseView:
        """Accepts the lighthouse's StatusResponse (trainer/lighthouse_quorum.py: quorum_id, max_step, members[],
        quorum_groups[], history[]); unknown fields are ignored, missing ones stay None."""
        groups: dict[str, LighthouseGroup] = {}
        for m in body.get("members") or []:
            if not isinstance(m, dict) or m.get("group") is None:
                continue
            gid = str(m["group"])
            groups[gid] = LighthouseGroup(
                group=gid,
                step=_int(m.get("step")),
                contributing=m.get("contributing"),
                finished=bool(m.get("finished", False)),
                param_digest=m.get("param_digest"),
                in_quorum=m.get("in_quorum"),
            )
        evicted: dict[str, str] = {}
        for h in body.get("history") or []:
            if isinstance(h, dict) and h.get("event") == "dropped":
                evicted[str(h.get("group"))] = str(h.get("reason", ""))
        quorum_groups = body.get("quorum_groups")
        return cls(
            quorum_id=_int(body.get("quorum_id")),
            quorum_size=len(quorum_groups) if isinstance(quorum_groups, list) else None,
            step=_int(body.get("max_step")),
            groups=groups,
            evicted=evicted,
        )


def _int(value: Any) -> int | None:
    try:
        return None if value is None else int(value)
    except (TypeError, ValueError):
        return None
