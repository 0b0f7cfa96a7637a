"""The docs site builds strictly, and its generated reference pages cover what they are generated from.

One `mkdocs build --strict` of the real site (mkdocs.yml) serves every page check; the checks read the sources on
their own (the CRD's schema, the Prometheus registries, ftjob.contract) rather than trusting the generator. Small
builds that inherit the site's settings show that strict mode refuses a broken link or anchor. No cluster.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "mkdocs.yml"
CRD = REPO / "crds" / "ftjob.dev_faulttoleranttrainingjobs.yaml"
MKDOCS = Path(sys.executable).parent / "mkdocs"  # the venv's, next to the Python running the tests
BUILD_TIMEOUT_S = 300  # a hung build fails the test instead of the whole run


def build(config: Path, site_dir: Path) -> subprocess.CompletedProcess[str]:
    """`mkdocs build --strict` of ``config`` into ``site_dir``."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # the theme's banner is no warning of ours
    cmd = [str(MKDOCS), "build", "--strict", "--config-file", str(config), "--site-dir", str(site_dir)]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real site, built once for every page check."""
    out = tmp_path_factory.mktemp("site")
    proc = build(CONFIG, out)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return out


def page(site: Path, name: str) -> str:
    """The built HTML of docs/reference/<name>.md."""
    return (site / "reference" / name / "index.html").read_text(encoding="utf-8")


def test_strict_build_makes_every_page_of_the_nav(site: Path) -> None:
    nav_pages = []

    def collect(items: list[Any]) -> None:
        for item in items:
            value = next(iter(item.values())) if isinstance(item, dict) else item
            if isinstance(value, list):
                collect(value)
            else:
                nav_pages.append(value)

    config = yaml.load(CONFIG.read_text(encoding="utf-8"), Loader=_ConfigLoader)
    collect(config["nav"])
    assert len(nav_pages) == 22
    missing = [p for p in nav_pages if not (site / _html_path(p)).is_file()]
    assert not missing, f"pages of the nav the build did not make: {missing}"


def test_crd_page_lists_every_field_of_the_schema(site: Path) -> None:
    crd = yaml.safe_load(CRD.read_text(encoding="utf-8"))
    (version,) = [v for v in crd["spec"]["versions"] if v.get("storage")]
    root = version["schema"]["openAPIV3Schema"]
    paths = [p for top in ("spec", "status") for p in field_paths(root["properties"][top], top)]
    assert "spec.failurePolicy.rules[].onExitCodes.values" in paths  # the walk reaches list items
    html = page(site, "crd")
    missing = [p for p in paths if f"<code>{p}</code>" not in html]
    assert not missing, f"schema fields the CRD page does not list: {missing}"
    # every CEL rule's message is there too (the API server's answer when the rule fails)
    messages = [" ".join(r["message"].split()) for r in cel_rules(root)]
    assert messages
    absent = [m for m in messages if _html_text(m) not in html]
    assert not absent, f"CEL rule messages the CRD page leaves out: {absent}"


def test_metrics_page_names_every_metric_of_each_registry(site: Path) -> None:
    from ftjob.ft.rank_metrics import TrainerMetrics
    from ftjob.lighthouse.server_metrics import LighthouseMetrics
    from ftjob.operator.runtime import operator_metrics  # noqa: F401  (registers the operator's metrics)
    from prometheus_client import REGISTRY

    registries = {
        "operator": [f for f in REGISTRY.collect() if f.name.startswith("ftjob_")],
        "lighthouse": list(LighthouseMetrics().registry.collect()),
        "trainer": list(TrainerMetrics().registry.collect()),
    }
    html = page(site, "metrics")
    for source, families in registries.items():
        assert families, source
        missing = [f.name for f in families if f"<code>{f.name}" not in html]
        assert not missing, f"{source} metrics the metrics page does not name: {missing}"


def test_env_page_names_every_env_variable_of_the_contract(site: Path) -> None:
    from ftjob import contract

    constants = {name: value for name, value in vars(contract).items() if name.startswith("ENV_")}
    assert len(constants) > 40
    html = page(site, "env")
    missing = [f"{name}={value}" for name, value in constants.items() if f"<code>{value}</code>" not in html]
    assert not missing, f"env variables of ftjob.contract the env page does not name: {missing}"


def test_every_env_variable_of_the_contract_is_described() -> None:
    from ftjob.contract import env_vars

    assert env_vars.undescribed() == []


def test_cli_page_shows_every_command_and_subcommand(site: Path) -> None:
    html = page(site, "cli")
    for command in ("ftjob-operator", "ftjob-trainer", "kubectl-ftjob"):
        assert f"<code>{command}</code>" in html
    for sub in ("lighthouse", "train", "launch", "supervise"):
        assert f"<code>ftjob-trainer {sub}</code>" in html
        assert f"usage: ftjob-trainer {sub}" in html
    for sub in ("status", "timeline", "events"):
        assert f"usage: kubectl ftjob {sub}" in html
    assert "--cordon-after-failures" in html and "--heartbeat-timeout" in html


def test_python_api_page_documents_every_public_name_of_ftjob_ft(site: Path) -> None:
    import ftjob.ft

    html = page(site, "python-api")
    missing = [name for name in ftjob.ft.__all__ if f'id="ftjob.ft.{name}"' not in html]
    assert not missing, f"names of ftjob.ft.__all__ the Python API page does not document: {missing}"


@pytest.mark.parametrize(
    "link",
    ["[a page that is not there](missing.md)", "[an anchor that is not there](other.md#no-such-heading)"],
    ids=["missing-page", "missing-anchor"],
)
def test_strict_build_refuses_a_broken_link(tmp_path: Path, link: str) -> None:
    assert build(small_site(tmp_path, "good link: [other](other.md#a-heading)"), tmp_path / "ok").returncode == 0
    proc = build(small_site(tmp_path, link), tmp_path / "broken")
    assert proc.returncode != 0, "a strict build with a broken link succeeded"
    assert "index.md" in proc.stdout + proc.stderr


def small_site(tmp_path: Path, line: str) -> Path:
    """A two-page site with the real site's settings (strict, validation) and ``line`` on its home page."""
    docs = tmp_path / "docs"
    docs.mkdir(exist_ok=True)
    (docs / "index.md").write_text(f"# Home\n\n{line}\n", encoding="utf-8")
    (docs / "other.md").write_text("# Other\n\n## A heading\n\ntext\n", encoding="utf-8")
    config = tmp_path / "mkdocs.yml"
    # Only the generated pages and their plugin are left out: they need the whole nav.
    config.write_text(
        f"INHERIT: {CONFIG}\ndocs_dir: {docs}\nhooks: []\nplugins: [search]\nnav: [index.md, other.md]\n",
        encoding="utf-8",
    )
    return config


def field_paths(schema: dict[str, Any], path: str) -> Iterator[str]:
    """``path`` and every property path below it: dotted, ``[]`` for a list's items, ``*`` for a map's values."""
    yield path
    yield from _paths_below(schema, path)


def _paths_below(schema: dict[str, Any], path: str) -> Iterator[str]:
    for name, sub in (schema.get("properties") or {}).items():
        yield from field_paths(sub, f"{path}.{name}")
    for key, suffix in (("items", "[]"), ("additionalProperties", ".*")):
        if isinstance(schema.get(key), dict):
            yield from _paths_below(schema[key], path + suffix)


def cel_rules(schema: Any) -> Iterator[dict[str, str]]:
    """Every x-kubernetes-validations rule anywhere in ``schema``."""
    if isinstance(schema, dict):
        yield from schema.get("x-kubernetes-validations") or ()
        for value in schema.values():
            yield from cel_rules(value)
    elif isinstance(schema, list):
        for value in schema:
            yield from cel_rules(value)


def _html_text(markdown: str) -> str:
    """How a one-line message with `code spans` reads in the built HTML."""
    escaped = markdown.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", escaped)


def _html_path(md: str) -> str:
    return "index.html" if md == "index.md" else md.removesuffix(".md") + "/index.html"


class _ConfigLoader(yaml.SafeLoader):
    """Reads mkdocs.yml, whose `!!python/name:` tags name Python objects this test has no need to import."""


_ConfigLoader.add_multi_constructor("tag:yaml.org,2002:python/name:", lambda loader, suffix, node: suffix)
