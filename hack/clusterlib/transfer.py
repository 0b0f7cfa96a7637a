"""Moving built images into the nodes' containerd without a registry, sending only the layers a node lacks.

buildah pushes every image into one OCI layout under the cache (uncompressed layers; a blob already there is
skipped). For each node we then write a small OCI archive holding the image's manifest, config and only those
layer blobs that node's containerd does not have, and `ctr images import` it: the other layers are found in its
content store. A code change thus moves megabytes, not the trainer's gigabytes of torch.
"""

from __future__ import annotations

import io
import json
import subprocess
import tarfile
import tempfile
from pathlib import Path

from clusterlib import images, runtime
from clusterlib.logs import Logged
from clusterlib.settings import Settings

LAYOUT_NAME_KEY = "org.opencontainers.image.ref.name"
CONTAINERD_NAME_KEY = "io.containerd.image.name"


def layout_dir(s: Settings) -> Path:
    return images.cache_dir(s) / "oci"


def _index(s: Settings) -> dict:
    path = layout_dir(s) / "index.json"
    return json.loads(path.read_text()) if path.exists() else {"schemaVersion": 2, "manifests": []}


def _blob(s: Settings, digest: str) -> Path:
    algo, hexa = digest.split(":", 1)
    return layout_dir(s) / "blobs" / algo / hexa


def export(s: Settings, log: Logged, image: images.Image) -> dict:
    """Push `image` into the layout (once) and return its manifest descriptor there."""
    for desc in _index(s)["manifests"]:
        if desc.get("annotations", {}).get(LAYOUT_NAME_KEY) == image.ref:
            return desc
    log.run(images.buildah(s, "push", "--disable-compression", "--quiet", image.ref,
                           f"oci:{layout_dir(s)}:{image.ref}"), heartbeat=f"exporting {image.ref}")  # fmt: skip
    for desc in _index(s)["manifests"]:
        if desc.get("annotations", {}).get(LAYOUT_NAME_KEY) == image.ref:
            return desc
    raise SystemExit(f"error: buildah pushed {image.ref} but the OCI layout at {layout_dir(s)} does not list it")


def node_blobs(s: Settings, n: int) -> set[str]:
    out = subprocess.run(runtime.ctr(s, n, "content", "ls", "-q"), capture_output=True, text=True).stdout
    return set(out.split())


def import_into(s: Settings, n: int, log: Logged, image: images.Image, desc: dict, have: set[str]) -> int:
    """Import `image` into node N, sending only the blobs it lacks; returns the bytes sent."""
    manifest = json.loads(_blob(s, desc["digest"]).read_bytes())
    wanted = [desc["digest"], manifest["config"]["digest"]] + [layer["digest"] for layer in manifest["layers"]]
    send = [d for d in dict.fromkeys(wanted) if d not in have or d in (desc["digest"], manifest["config"]["digest"])]
    index = {
        "schemaVersion": 2,
        "manifests": [{**desc, "annotations": {CONTAINERD_NAME_KEY: image.ref, LAYOUT_NAME_KEY: image.ref}}],
    }
    sent = 0
    with tempfile.NamedTemporaryFile(dir=images.cache_dir(s), suffix=".tar") as tmp:
        with tarfile.open(tmp.name, "w") as tar:
            _add_bytes(tar, "oci-layout", b'{"imageLayoutVersion": "1.0.0"}')
            _add_bytes(tar, "index.json", json.dumps(index).encode())
            for digest in send:
                path = _blob(s, digest)
                tar.add(str(path), arcname=f"blobs/{digest.replace(':', '/')}")
                sent += path.stat().st_size
        log.run(runtime.ctr(s, n, "images", "import", tmp.name), heartbeat=f"importing {image.ref} into node {n}")
    return sent


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def prune(s: Settings, keep: list[str]) -> None:
    """Forget every image in the layout but `keep` (refs), and delete the blobs nothing kept refers to."""
    index = _index(s)
    index["manifests"] = [d for d in index["manifests"] if d.get("annotations", {}).get(LAYOUT_NAME_KEY) in keep]
    used = set()
    for desc in index["manifests"]:
        manifest = json.loads(_blob(s, desc["digest"]).read_bytes())
        used |= {desc["digest"], manifest["config"]["digest"], *(x["digest"] for x in manifest["layers"])}
    (layout_dir(s) / "index.json").write_text(json.dumps(index))
    for path in (layout_dir(s) / "blobs").glob("*/*"):
        if f"{path.parent.name}:{path.name}" not in used:
            path.unlink()
