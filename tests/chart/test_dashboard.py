"""The Grafana dashboard the chart ships (dashboards/ftjob.json): valid, with the panels the job needs, every query
naming only metrics the project really exports (read from the live registries, not from a list kept here), and the
opt-in ConfigMap the Grafana sidecar loads rendered only when enabled."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from tests.support.helm import CHART, render

DASHBOARD = CHART / "dashboards" / "ftjob.json"

# Panels the issue asks for: title -> a metric one of its queries must use
REQUIRED_PANELS = {
    "Committed step": "ftjob_job_committed_step",
    "Quorum size": "ftjob_job_quorum_size",
    "Groups by state": "ftjob_job_groups",
    "Step time": "ftjob_trainer_step_seconds_bucket",
    "Tokens/s": "ftjob_trainer_tokens_per_second",
    "Goodput": "ftjob_job_goodput_ratio",
    "Badput by cause (wall seconds)": "ftjob_job_badput_seconds",
    "Restarts by reason": "ftjob_group_restarts_total",
    "Evictions by reason": "ftjob_lighthouse_evictions_total",
    "Heal time": "ftjob_trainer_heal_seconds_bucket",
}

# PromQL's functions, aggregation operators and keywords (https://prometheus.io/docs/prometheus/latest/querying/)
PROMQL_FUNCTIONS = frozenset(
    re.findall(
        r"\S+",
        """abs absent absent_over_time acos acosh asin asinh atan atanh avg_over_time ceil changes clamp clamp_max
        clamp_min cos cosh count_over_time day_of_month day_of_week day_of_year days_in_month deg delta deriv exp floor
        histogram_avg histogram_count histogram_fraction histogram_quantile histogram_stddev histogram_stdvar
        histogram_sum holt_winters double_exponential_smoothing hour idelta increase irate label_join label_replace
        last_over_time ln log10 log2 mad_over_time max_over_time min_over_time minute month pi predict_linear
        present_over_time quantile_over_time rad rate resets round scalar sgn sin sinh sort sort_by_label
        sort_by_label_desc sort_desc sqrt stddev_over_time stdvar_over_time sum_over_time tan tanh time timestamp vector
        year sum min max avg group stddev stdvar count count_values bottomk topk quantile limitk limit_ratio""",
    )
)
_KEYWORDS = "and or unless bool offset by without on ignoring group_left group_right inf nan"
PROMQL_KEYWORDS = frozenset(re.findall(r"\S+", _KEYWORDS))
GRAFANA_QUERY_FUNCTIONS = {"label_values", "label_names", "metrics", "query_result"}
IDENT = re.compile(r"(?<![\w.:$])[a-zA-Z_:][a-zA-Z0-9_:]*")


def family_samples(name: str, kind: str) -> set[str]:
    """The sample names a metric family is exposed as (a labelled family without children emits no samples yet)."""
    return {
        "counter": {f"{name}_total", f"{name}_created"},
        "gauge": {name},
        "histogram": {f"{name}_bucket", f"{name}_sum", f"{name}_count", f"{name}_created"},
        "gaugehistogram": {f"{name}_bucket", f"{name}_gsum", f"{name}_gcount"},
        "summary": {name, f"{name}_sum", f"{name}_count", f"{name}_created"},
        "info": {f"{name}_info"},
        "stateset": {name},
    }.get(kind, {name})


@cache
def exported_metrics() -> frozenset[str]:
    """Every sample name the operator, the lighthouse and the trainer library export, from their registries."""
    import ftjob.operator.runtime.operator_metrics  # noqa: F401  (registers the operator's metrics in the global registry)
    import prometheus_client
    from ftjob.ft.rank_metrics import TrainerMetrics
    from ftjob.lighthouse.server_metrics import LighthouseMetrics

    names: set[str] = set()
    for registry in (prometheus_client.REGISTRY, LighthouseMetrics().registry, TrainerMetrics().registry):
        for family in registry.collect():
            names |= family_samples(family.name, family.type)
            names |= {s.name for s in family.samples}
    return frozenset(names)


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def all_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for p in panels:
        yield p
        yield from all_panels(p.get("panels") or [])  # a (collapsed) row keeps its panels inside


def queries(dash: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, expr) of every panel target and every query variable."""
    for p in all_panels(dash.get("panels") or []):
        for t in p.get("targets") or []:
            if "expr" in t:
                yield f"panel {p.get('title')!r}", t["expr"]
    for v in (dash.get("templating") or {}).get("list") or []:
        if v.get("type") == "query":
            q = v.get("query")
            yield f"variable ${v['name']}", q.get("query", "") if isinstance(q, dict) else str(q)


def metric_names(expr: str) -> set[str]:
    """The metric identifiers of a PromQL expression (or a Grafana label_values(...) query)."""
    m = re.fullmatch(r"\s*label_values\((.*),\s*[a-zA-Z_][a-zA-Z0-9_]*\s*\)\s*", expr, re.S)
    if m:
        expr = m.group(1)
    s = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', expr)  # string literals
    s = re.sub(r"\{[^{}]*\}", " ", s)  # label matchers
    s = re.sub(r"\[[^\]]*\]", " ", s)  # range / subquery durations ($__rate_interval, 5m)
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)  # label lists
    s = re.sub(r"\$\{?\w+\}?", " ", s)  # Grafana variables outside selectors
    names = set()
    for tok in IDENT.finditer(s):
        word, rest = tok.group(0), s[tok.end() :].lstrip()
        if rest.startswith("("):
            assert word in PROMQL_FUNCTIONS | GRAFANA_QUERY_FUNCTIONS, f"unknown PromQL function {word!r} in {expr!r}"
            continue
        if word.lower() in PROMQL_KEYWORDS:
            continue
        names.add(word)
    return names


def test_metric_name_extraction() -> None:
    expr = (
        'histogram_quantile(0.9, sum by (le, job) (rate(a_bucket{x="y", z=~"b|c"}[$__rate_interval]))) '
        "/ on (job) group_left (k) max without (pod) (b_total offset 5m) > bool 1e3"
    )
    assert metric_names(expr) == {"a_bucket", "b_total"}
    assert metric_names('label_values(c_step{namespace="$namespace"}, job)') == {"c_step"}
    assert metric_names("sum(d)") == {"d"}


def test_dashboard_is_a_grafana_model_with_the_panels_the_issue_lists() -> None:
    dash = dashboard()  # valid JSON, or this raises
    assert dash["uid"] and len(dash["uid"]) <= 40 and dash["title"]
    assert isinstance(dash.get("schemaVersion"), int) and dash["schemaVersion"] >= 36  # Grafana 10+
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert {"namespace", "job"} <= set(variables)
    panels = {p["title"]: p for p in all_panels(dash["panels"]) if p.get("type") != "row"}
    ids = [p["id"] for p in all_panels(dash["panels"])]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for title, metric in REQUIRED_PANELS.items():
        assert title in panels, f"no panel {title!r}; panels: {sorted(panels)}"
        used = set().union(*(metric_names(t["expr"]) for t in panels[title]["targets"]))
        assert metric in used, f"panel {title!r} does not query {metric}: {used}"
    for p in panels.values():
        assert p["datasource"]["uid"] == "${datasource}", f"panel {p['title']!r} must use the $datasource variable"
        assert p["targets"], f"panel {p['title']!r} has no query"


def test_every_query_names_an_exported_metric() -> None:
    exported = exported_metrics()
    found = list(queries(dashboard()))
    assert len(found) >= len(REQUIRED_PANELS)
    unknown = {(where, name) for where, expr in found for name in metric_names(expr) if name not in exported}
    assert not unknown, f"the dashboard queries metrics nobody exports: {sorted(unknown)}"


def test_trainer_and_lighthouse_queries_select_the_job() -> None:
    """Series the PodMonitor scrapes from pods carry the pod labels (ftjob_dev_job) and the pod's namespace."""
    for where, expr in queries(dashboard()):
        for sel in re.finditer(r"(ftjob_(?:trainer|lighthouse)_\w+)\{([^}]*)\}", expr):
            assert 'ftjob_dev_job="$job"' in sel.group(2) and 'namespace="$namespace"' in sel.group(2), (where, expr)
        for name in metric_names(expr):
            if name.startswith(("ftjob_trainer_", "ftjob_lighthouse_")) and name != "ftjob_lighthouse_calls_total":
                assert re.search(rf"{name}\{{", expr), f"{where}: {name} without a job selector in {expr!r}"


def dashboard_configmaps(values: dict[str, str]) -> list[dict[str, Any]]:
    objs = render("dash", "ftjob-system", values)
    return [o for o in objs if o["kind"] == "ConfigMap" and "ftjob.json" in (o.get("data") or {})]


def test_configmap_is_opt_in() -> None:
    assert dashboard_configmaps({}) == []


def test_configmap_renders_for_the_grafana_sidecar() -> None:
    (cm,) = dashboard_configmaps({"grafanaDashboard.enabled": "true"})
    assert cm["metadata"]["namespace"] == "ftjob-system"
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["ftjob.json"]) == dashboard()
    (cm,) = dashboard_configmaps(
        {
            "grafanaDashboard.enabled": "true",
            "grafanaDashboard.namespace": "monitoring",
            "grafanaDashboard.labels.team": "ml",
        }
    )
    assert cm["metadata"]["namespace"] == "monitoring" and cm["metadata"]["labels"]["team"] == "ml"


@pytest.mark.parametrize("path", [DASHBOARD])
def test_dashboard_is_packaged(path: Path) -> None:
    ignored = (CHART / ".helmignore").read_text().split()
    assert not any(path.match(p) for p in ignored if not p.startswith("#"))
