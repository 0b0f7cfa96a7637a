"""The example manifests and the Helm chart's defaults name images the local cluster carries in every node, with a
pull policy that never asks a registry (no cluster: hack/clusterlib's naming against the files)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "crds" / "examples").glob("*.yaml")) + sorted((REPO / "examples" / "k8s").glob("*.yaml"))


@pytest.fixture(scope="module")
def images() -> ModuleType:
    from clusterlib import images  # hack/ is on pytest's pythonpath: hack/cluster's own package

    return images


def needs_gpu(path: Path) -> bool:
    return "nvidia.com/gpu" in path.read_text()


def containers(path: Path) -> list[dict[str, Any]]:
    pod = yaml.safe_load(path.read_text())["spec"]["template"]["spec"]
    return [*pod.get("initContainers", []), *pod["containers"]]


def carried(images: ModuleType, name: str) -> tuple[str, ...]:
    """The names a node's containerd gives the local build of image `name` (the digest does not matter here)."""
    return images.dockerfile_image(name, images.project_version(REPO), "0123456789ab").aliases


def test_every_runnable_example_names_the_local_trainer_build(images: ModuleType) -> None:
    runnable = [p for p in EXAMPLES if not needs_gpu(p)]
    assert {p.stem for p in runnable} >= {"tiny-cpu", "mlp", "fsdp", "gpt", "ddp"}
    for path in runnable:
        for c in containers(path):
            image = c["image"]
            assert images.containerd_name(image) in carried(images, "trainer"), f"{path.name}: {image}"
            # without a policy the kubelet's default for a tag other than `latest` is IfNotPresent: the node's copy
            assert ":" in image.rpartition("/")[2] and not image.endswith(":latest"), f"{path.name}: {image}"
            assert c.get("imagePullPolicy", "IfNotPresent") == "IfNotPresent", f"{path.name}: {c['imagePullPolicy']}"


def test_the_gpu_example_says_it_cannot_run_locally() -> None:
    gpu = [p for p in EXAMPLES if needs_gpu(p)]
    assert [p.name for p in gpu] == ["gpu-llm.yaml"]
    text = gpu[0].read_text()
    assert "cannot run on" in text and "local cluster" in text and "--dry-run=server" in text


def test_the_charts_default_operator_image_is_the_local_build(images: ModuleType) -> None:
    chart = yaml.safe_load((REPO / "charts" / "ftjob-operator" / "Chart.yaml").read_text())
    values = yaml.safe_load((REPO / "charts" / "ftjob-operator" / "values.yaml").read_text())["image"]
    assert chart["appVersion"] == images.project_version(REPO)
    assert not values["tag"] and not values["digest"] and values["pullPolicy"] == "IfNotPresent"
    default = f"{values['repository']}:{chart['appVersion']}"  # the chart's "ftjob.image" helper
    assert images.containerd_name(default) in carried(images, "operator")


@pytest.mark.parametrize(
    ("ref", "stored"),
    [
        ("ftjob-trainer:0.1.0", "docker.io/library/ftjob-trainer:0.1.0"),
        ("team/ftjob-trainer:0.1.0", "docker.io/team/ftjob-trainer:0.1.0"),
        ("ftjob.local/ftjob-trainer:dev", "ftjob.local/ftjob-trainer:dev"),
        ("registry:5000/ftjob-trainer:0.1.0", "registry:5000/ftjob-trainer:0.1.0"),
        ("localhost/ftjob-trainer:0.1.0", "localhost/ftjob-trainer:0.1.0"),
    ],
)
def test_names_are_stored_as_the_kubelet_asks_containerd_for_them(images: ModuleType, ref: str, stored: str) -> None:
    assert images.containerd_name(ref) == stored
