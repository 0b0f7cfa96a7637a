"""`kubectl ftjob` (ftjob.operator.kubectl): rendering from a canned job and Events, argument parsing, the kubeconfig
honoured, a missing job, and the timeline PNG — against a stub apiserver on localhost, no cluster."""

from __future__ import annotations

import json
import threading
import tomllib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest
import yaml
from ftjob.operator.kubectl import cli, status_view, timeline
from ftjob.operator.kubectl import events as ev

REPO = Path(__file__).resolve().parents[2]
T0 = 1_780_000_000.0  # the job's creation, unix seconds
NOW = T0 + 600


def iso(t: float) -> str:
    import datetime as dt

    return dt.datetime.fromtimestamp(t, tz=dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def canned_job() -> dict[str, Any]:
    history = []
    for i in range(60):  # a sample every 10 s; group 1 is killed at 200 s and back at 260 s
        t = T0 + 10 * i
        step = 4 * i
        groups = {"0": step, "2": step}
        if 10 * i < 200 or 10 * i >= 270:
            groups["1"] = step
        elif 10 * i == 260:
            groups["1"] = step - 8  # back, but healing: behind the job
        history.append({"t": t, "step": step, "quorum": 3 if "1" in groups else 2, "groups": groups})
    return {
        "apiVersion": "ftjob.dev/v1alpha1",
        "kind": "FaultTolerantTrainingJob",
        "metadata": {"name": "tiny", "namespace": "team-a", "creationTimestamp": iso(T0), "uid": "u1"},
        "spec": {"replicas": 3, "minReplicas": 2, "podsPerReplica": 2},
        "status": {
            "phase": "Running",
            "ready": "3/3",
            "totalRestarts": 1,
            "restartsByReason": {"PodDeleted": 1},
            "quorum": {"id": 7, "size": 3, "step": 236},
            "replicaGroups": [
                {"index": 0, "phase": "Running", "generation": 0, "restarts": 0,
                 "pods": ["tiny-g0-0-r0", "tiny-g0-0-r1"], "node": "node-1", "step": 236,
                 "contributing": True, "spare": False},
                {"index": 1, "phase": "Running", "generation": 1, "restarts": 1,
                 "pods": ["tiny-g1-1-r0", "tiny-g1-1-r1"], "node": "node-2", "step": 230,
                 "contributing": False, "spare": False,
                 "lastFailure": "PodDeleted: pod tiny-g1-0-r0 was deleted"},
                {"index": 2, "phase": "Pending", "generation": 0, "restarts": 0, "pods": ["tiny-g2-0-r0"],
                 "waiting": "Unschedulable: 0/2 nodes are available"},
            ],
            "goodput": {
                "ratio": 0.931, "groupRatio": 0.88, "percent": "93.1%", "elapsedSeconds": 590.0,
                "productiveSeconds": 549.3, "stepSeconds": 2.5,
                "badputSeconds": {"startup": 12.0, "failureStall": 20.5, "rejoin": 8.2, "belowMinimum": 0, "other": 0},
            },
            "history": history,
        },
    }  # fmt: skip


def core_event(reason: str, message: str, t: float, type_: str = "Warning", count: int = 1) -> dict[str, Any]:
    return {
        "metadata": {"name": f"tiny.{reason}", "namespace": "team-a"},
        "involvedObject": {"kind": "FaultTolerantTrainingJob", "name": "tiny"},
        "type": type_,
        "reason": reason,
        "message": message,
        "firstTimestamp": iso(t),
        "lastTimestamp": iso(t),
        "count": count,
    }


def canned_events() -> list[dict[str, Any]]:
    return [
        core_event("ScaledUp", "added replica group 2 (spec.replicas=3)", T0 + 5, "Normal"),
        core_event("GroupRestart", "PodDeleted: replica group 1 restarts as generation 1", T0 + 200),
        core_event("LighthouseEvicted", "the lighthouse dropped replica group 1: heartbeat", T0 + 201, "Normal"),
        core_event("Unschedulable", "0/2 nodes are available", T0 + 300, count=4),
    ]


def test_status_renders_one_screen() -> None:
    out = status_view.render(canned_job(), ev.from_list(canned_events()), NOW)
    print(out)
    lines = out.splitlines()
    assert len(lines) <= 25, "one screen"
    assert lines[0].startswith("Job:") and "tiny" in lines[0] and "team-a" in lines[0] and "10m" in lines[0]
    assert "Running" in lines[1]
    assert "id 7" in out and "size 3" in out and "committed step 236" in out
    assert "93.1%" in out and "group 88.0%" in out
    assert "failureStall 20.5s, startup 12.0s, rejoin 8.2s" in out  # the top causes, largest first
    table = [line.split() for line in lines if line[:1].isdigit()]
    assert table[0][:7] == ["0", "contributing", "2/2", "0", "0", "236", "node-1"]
    assert table[1][:3] == ["1", "healing", "2/2"]
    assert table[2][:3] == ["2", "Pending", "1/2"] and "Unschedulable: 0/2" in " ".join(table[2])
    failures = out.split("Last failures")[1]
    assert "Unschedulable" in failures and "(x4)" in failures and "GroupRestart" in failures
    assert "ScaledUp" not in failures
    assert failures.index("Unschedulable") < failures.index("GroupRestart"), "newest first"


def test_status_of_a_fresh_job_shows_dashes() -> None:
    job = {"metadata": {"name": "new", "namespace": "ns"}, "spec": {}}
    out = status_view.render(job, [], NOW)
    assert "Phase:     -" in out and "id -   size -   committed step -" in out
    assert "Goodput:   -   group -" in out and "Badput:    -" in out
    assert "(no replica groups in status yet)" in out and "(none)" in out


def test_events_of_both_apis_are_normalised() -> None:
    core = ev.normalize(core_event("GroupRestart", "replica group 3 restarts", T0, count=2))
    new = ev.normalize(
        {"reason": "GroupRestart", "note": "replica group 3 restarts", "type": "Warning", "eventTime": iso(T0),
         "series": {"count": 2, "lastObservedTime": iso(T0 + 9)}, "regarding": {"name": "tiny"}}
    )  # fmt: skip
    assert (core.reason, core.message, core.count, core.time, core.group) == (
        "GroupRestart", "replica group 3 restarts", 2, T0, 3
    )  # fmt: skip
    assert (new.message, new.count, new.time, new.first_time, new.group) == (
        "replica group 3 restarts",
        2,
        T0 + 9,
        T0,
        3,
    )
    assert ev.normalize({"reason": "Succeeded", "type": "Normal"}).kind == ev.RECOVERY
    assert ev.normalize({"reason": "Anything", "type": "Warning"}).kind == ev.FAILURE
    assert ev.normalize({"reason": "ScaledUp", "type": "Normal"}).kind == ev.OTHER
    table = ev.render(ev.from_list(canned_events()), NOW)
    assert table.splitlines()[0].split() == ["AGE", "TYPE", "REASON", "COUNT", "MESSAGE"]
    assert [line.split()[2] for line in table.splitlines()[1:]] == [
        "ScaledUp", "GroupRestart", "LighthouseEvicted", "Unschedulable"
    ]  # fmt: skip
    assert "ScaledUp" not in ev.render(ev.from_list(canned_events()), NOW, only_failures=True)


def test_arguments_before_and_after_the_subcommand() -> None:
    p = cli.parser()
    a = p.parse_args(["-n", "ns1", "--context", "c1", "status", "tiny"])
    assert (a.command, a.job, a.namespace, a.context, a.kubeconfig) == ("status", "tiny", "ns1", "c1", None)
    a = p.parse_args(["timeline", "tiny", "-o", "x.png", "--namespace", "ns2", "--kubeconfig", "/k"])
    assert (a.command, a.output, a.namespace, a.kubeconfig, a.no_events) == (
        "timeline",
        Path("x.png"),
        "ns2",
        "/k",
        False,
    )
    a = p.parse_args(["events", "tiny", "--failures"])
    assert a.failures and a.namespace is None
    with pytest.raises(SystemExit):
        p.parse_args(["timeline", "tiny"])  # -o is required
    with pytest.raises(SystemExit):
        p.parse_args(["status"])  # the job is required


def test_console_script_is_declared() -> None:
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert meta["project"]["scripts"]["kubectl-ftjob"] == "ftjob.operator.kubectl.cli:main"
    assert "ftjob.operator.kubectl" in meta["tool"]["setuptools"]["packages"]


def test_timeline_marks_failures_and_derived_recoveries(tmp_path: Path) -> None:
    job, events = canned_job(), ev.from_list(canned_events())
    marks = timeline.marks(job, events)
    kinds = [(m.t - T0, m.kind, m.label) for m in marks]
    assert (200, ev.FAILURE, "GroupRestart") in kinds
    assert (270, ev.RECOVERY, "group 1 back (70s)") in kinds, kinds  # at 260 it still healed (behind the job)
    png = tmp_path / "sub" / "t.png"
    assert timeline.plot(job, events, png) == 60
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    with pytest.raises(timeline.TimelineError, match=r"no status\.history"):
        timeline.plot({"metadata": {"name": "x"}, "status": {}}, [], tmp_path / "none.png")


# --- the whole command against a stub apiserver on localhost (kubeconfig, context, namespace, 404) ---


class StubApiserver(BaseHTTPRequestHandler):
    jobs: dict[tuple[str, str], dict[str, Any]] = {}
    events: list[dict[str, Any]] = []
    seen: list[str] = []

    def do_GET(self) -> None:
        url = urlparse(self.path)
        self.seen.append(self.path)
        parts = url.path.strip("/").split("/")
        body: Any
        if url.path.startswith("/apis/ftjob.dev/") and len(parts) == 7:  # apis/g/v/namespaces/ns/plural/name
            body = self.jobs.get((parts[4], parts[6]))
        elif url.path.endswith("/events"):
            selector = parse_qs(url.query).get("fieldSelector", [""])[0]
            items = [e for e in self.events if f"involvedObject.name={e['involvedObject']['name']}" in selector]
            body = {"kind": "EventList", "apiVersion": "v1", "items": items}
        else:
            body = None
        code = 200 if body is not None else 404
        data = json.dumps(body or {"kind": "Status", "status": "Failure", "reason": "NotFound", "code": 404}).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *_: Any) -> None:
        pass


@pytest.fixture
def kubeconfig(tmp_path: Path) -> Iterator[Path]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), StubApiserver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "stub", "cluster": {"server": url}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [
            {"name": "a", "context": {"cluster": "stub", "user": "u", "namespace": "team-a"}},
            {"name": "b", "context": {"cluster": "stub", "user": "u", "namespace": "team-b"}},
        ],
        "current-context": "b",
    }
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(cfg))
    StubApiserver.jobs = {("team-a", "tiny"): canned_job()}
    StubApiserver.events = canned_events()
    StubApiserver.seen = []
    yield path
    server.shutdown()


def test_status_command_uses_the_context_namespace(kubeconfig: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--kubeconfig", str(kubeconfig), "--context", "a", "status", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "committed step 236" in out and "GroupRestart" in out
    assert any("/namespaces/team-a/faulttoleranttrainingjobs/tiny" in p for p in StubApiserver.seen)
    events_call = next(p for p in StubApiserver.seen if "/events" in p)
    assert "involvedObject.kind%3DFaultTolerantTrainingJob" in events_call or "FaultTolerantTrainingJob" in events_call


def test_missing_job_is_one_line_and_exit_1(kubeconfig: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # the current context "b" says team-b, where there is no job "tiny"
    assert cli.main(["--kubeconfig", str(kubeconfig), "status", "tiny"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error:") and '"tiny" not found in namespace "team-b"' in err
    assert cli.main(["--kubeconfig", str(kubeconfig), "events", "nope", "-n", "team-a"]) == 1


def test_timeline_and_events_commands(kubeconfig: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "timeline.png"
    assert cli.main(["--kubeconfig", str(kubeconfig), "-n", "team-a", "timeline", "tiny", "-o", str(png)]) == 0
    captured = capsys.readouterr()
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert "kubectl-ftjob: reading job team-a/tiny" in captured.err and f"wrote {png}" in captured.err  # progress
    assert cli.main(["--kubeconfig", str(kubeconfig), "events", "tiny", "-n", "team-a", "--failures"]) == 0
    out = capsys.readouterr().out
    assert "GroupRestart" in out and "ScaledUp" not in out


def test_status_says_when_the_whole_job_was_restored() -> None:
    job = canned_job()
    job["status"]["restored"] = {"quorumId": 9, "fromStep": 183, "toStep": 150, "time": "2026-12-07T09:00:00Z"}
    out = status_view.render(job, [], NOW)
    assert "Restored:  from checkpoint of step 150 after losing step 183 (33 steps trained again)" in out
    job["status"]["restored"] = {"quorumId": 9, "fromStep": 40, "toStep": 0, "time": "2026-12-07T09:00:00Z"}
    assert "from step 0 (no checkpoint)" in status_view.render(job, [], NOW)
    assert "Restored:" not in status_view.render(canned_job(), [], NOW)
