"""hack/demo's own timeline (hack/lib/demo_timeline.py): the kill is marked once, where the lighthouse's samples show
the group drop out, and the PNG draws it."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def demo_timeline() -> ModuleType:
    from hack.lib import demo_timeline

    return demo_timeline


def sample(dt: ModuleType, t: float, present: dict[str, str]) -> object:
    """A lighthouse sample at `t` with the groups in `present` (group -> incarnation) in the quorum."""
    groups = {g: dt.GroupSample(int(t), True, True, False, inc) for g, inc in present.items()}
    return dt.Sample(t, int(t), sorted(present), groups)


def test_the_kill_is_marked_where_the_group_dropped_out(demo_timeline: ModuleType, tmp_path: Path) -> None:
    tl = demo_timeline.Timeline("tiny")
    for t in (9.0, 9.5, 10.0, 10.5, 11.0, 11.5):  # killed at 9.6 s; the lighthouse keeps it until its heartbeat lapses
        tl.samples.append(sample(demo_timeline, t, {"0": "a", "1": "b", "2": "c"}))
    for t in (11.9, 12.4, 13.0):
        tl.samples.append(sample(demo_timeline, t, {"0": "a", "2": "c"}))
    tl.samples.append(sample(demo_timeline, 20.0, {"0": "a", "1": "d", "2": "c"}))
    assert tl.dropped_out("1", "b", since=9.6) == 11.9
    assert tl.dropped_out("0", "a", since=9.6) is None
    replaced = demo_timeline.Timeline("tiny", samples=[tl.samples[0], tl.samples[-1]])  # back before a sample missed it
    assert replaced.dropped_out("1", "b", since=9.6) == 20.0
    tl.mark(20.0, "recovered", "group 1 back")
    tl.mark(11.9, "kill", "group 1 out")
    png = tmp_path / "t.png"
    demo_timeline.plot(tl, png, "tiny")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
