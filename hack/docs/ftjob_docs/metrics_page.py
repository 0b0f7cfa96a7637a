"""docs/reference/metrics.md: every Prometheus metric ftjob exports, read from the live collectors.

The operator's metrics live in prometheus-client's default registry (module-level collectors of
ftjob.operator.runtime.operator_metrics); the lighthouse's and a trainer rank's each in a registry of their own,
made by instantiating LighthouseMetrics and TrainerMetrics. A family a registry exposes that no collector found here
explains fails the build.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

from ftjob_docs import GENERATED_NOTE
from ftjob_docs.markdown import code, table, text

# What prometheus-client appends to a family's name in the exposition format, by type.
SERIES_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count")}


@dataclass(frozen=True)
class MetricDoc:
    """One metric family as a scrape sees it."""

    name: str  # the family's name (prometheus-client drops a counter's _total from it)
    kind: str  # counter, gauge, histogram, ...
    help: str
    labels: tuple[str, ...]

    @property
    def series(self) -> tuple[str, ...]:
        """The sample names a scrape shows for this family."""
        return tuple(self.name + s for s in SERIES_SUFFIXES.get(self.kind, ("",)))


@dataclass(frozen=True)
class Source:
    """The metrics of one process: where they are served and their families."""

    title: str
    served: str
    metrics: tuple[MetricDoc, ...]


def describe(collectors: Iterable[MetricWrapperBase]) -> tuple[MetricDoc, ...]:
    """Each collector as a MetricDoc, by name."""
    docs = []
    for collector in collectors:
        (family,) = collector.describe()
        # prometheus-client has no public accessor for a wrapper's label names
        docs.append(MetricDoc(family.name, family.type, family.documentation, tuple(collector._labelnames)))
    return tuple(sorted(docs, key=lambda d: d.name))


def collectors_of(owner: Any) -> list[MetricWrapperBase]:
    """The metric collectors among an object's (or module's) attributes."""
    return [v for v in vars(owner).values() if isinstance(v, MetricWrapperBase)]


def check_complete(docs: tuple[MetricDoc, ...], registry: CollectorRegistry, prefix: str) -> None:
    """Raises unless every family ``registry`` exposes under ``prefix`` is among ``docs``."""
    exposed = {family.name for family in registry.collect() if family.name.startswith(prefix)}
    missing = sorted(exposed - {d.name for d in docs})
    if missing:
        raise RuntimeError(f"metrics exposed but not found as collectors, so not documented: {missing}")


def sources() -> list[Source]:
    """The operator's, the lighthouse's and a trainer rank's metrics."""
    from ftjob.contract import ENV_METRICS_PORT, LIGHTHOUSE_PORT, PATH_METRICS
    from ftjob.ft.rank_metrics import TrainerMetrics
    from ftjob.lighthouse.server_metrics import LighthouseMetrics
    from ftjob.operator.runtime import operator_metrics
    from prometheus_client import REGISTRY

    operator = describe(collectors_of(operator_metrics))
    check_complete(operator, REGISTRY, "ftjob_")
    lighthouse_metrics, trainer_metrics = LighthouseMetrics(), TrainerMetrics()
    lighthouse = describe(collectors_of(lighthouse_metrics))
    check_complete(lighthouse, lighthouse_metrics.registry, "")
    trainer = describe(collectors_of(trainer_metrics))
    check_complete(trainer, trainer_metrics.registry, "")
    return [
        Source("Operator", "`ftjob-operator --metrics-port` (default 8080), path `/metrics`", operator),
        Source(
            "Lighthouse",
            f"the lighthouse's API port ({LIGHTHOUSE_PORT}), path `{PATH_METRICS}` (either job token)",
            lighthouse,
        ),
        Source(
            "Trainer rank",
            f"every rank on `{ENV_METRICS_PORT}` (ftjob.ft.rank_metrics), container port `metrics`",
            trainer,
        ),
    ]


def render() -> str:
    """The page's Markdown."""
    out = [
        "# Metrics reference\n",
        GENERATED_NOTE.format(source="the processes' Prometheus registries"),
        "Each family lists the sample names a scrape shows: a counter's `_total`, a histogram's `_bucket`, `_sum` "
        "and `_count` (prometheus-client also exposes a `_created` timestamp for counters and histograms). "
        "Trainer and lighthouse metrics carry no job, group or rank labels: Prometheus takes those from the pod's "
        "labels.\n",
    ]
    for source in sources():
        rows = [
            [
                "<br>".join(code(s) for s in m.series),
                m.kind,
                ", ".join(code(label) for label in m.labels),
                text(m.help),
            ]
            for m in source.metrics
        ]
        out += [
            f"## {source.title}\n",
            f"Served by {source.served}.\n",
            table(["Metric", "Type", "Labels", "Help"], rows),
        ]
    return "\n".join(out)
