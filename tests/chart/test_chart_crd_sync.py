"""The chart ships the CRD of crds/ byte for byte. crds/ is the one source of truth; the chart holds a copy because
`helm package` handles symlinks poorly and Helm installs only real files under a chart's crds/. After changing the CRD:
    cp crds/*.yaml charts/ftjob-operator/crds/
"""

from __future__ import annotations

import yaml
from ftjob import contract

from tests.support.helm import CHART
from tests.support.paths import REPO

SOURCE = REPO / "crds"
COPY = CHART / "crds"
FIX = "run `cp crds/*.yaml charts/ftjob-operator/crds/` (crds/ is the source of truth) and commit both"


def test_chart_crds_equal_the_source_crds() -> None:
    source = {p.name: p.read_bytes() for p in sorted(SOURCE.glob("*.yaml"))}
    copy = {p.name: p.read_bytes() for p in sorted(COPY.glob("*.yaml"))}
    assert source, f"no CRD in {SOURCE}"
    assert set(copy) == set(source), f"chart CRD files {sorted(copy)} != {sorted(source)}: {FIX}"
    stale = [name for name in source if copy[name] != source[name]]
    assert not stale, f"chart copies differ from crds/: {stale}: {FIX}"


def test_the_chart_crd_is_the_ftjob_kind_of_the_contract() -> None:
    docs = [d for p in sorted(COPY.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]
    crd = next(d for d in docs if d["kind"] == "CustomResourceDefinition")
    assert crd["spec"]["group"] == contract.API_GROUP
    assert crd["spec"]["names"]["kind"] == contract.KIND
    assert crd["spec"]["names"]["plural"] == contract.PLURAL
    assert contract.API_VERSION in [v["name"] for v in crd["spec"]["versions"]]
