"""The cluster's container images, built locally (no registry is reachable) and imported into every node.

    ftjob.local/pause            the pod sandbox: hack/nodetools' static `pause`, nothing else
    ftjob.local/debian-python    Debian bookworm (debootstrap minbase) + python3: the base of the two images below
    ftjob.local/ftjob-operator   hack/images/operator.Dockerfile (ftjob without torch)
    ftjob.local/ftjob-trainer    hack/images/trainer.Dockerfile (ftjob[trainer], torch included)

Each image is tagged by a hash of everything it is built from, so an unchanged checkout rebuilds nothing, and also
`:dev` (what the tests' manifests name). The operator and trainer images are also named in every node as a release is
(`ftjob-operator:<version>`, `ftjob-trainer:<version>`, the version from pyproject.toml): what the Helm chart's defaults
and the examples under crds/examples/ and examples/k8s/ name, so they run here as written. Those names carry a tag
that is not `latest`, so the kubelet's default pull policy (IfNotPresent) uses the node's copy and never asks a
registry. buildah keeps its storage under the ftjob cache; a node imports an image only when its containerd lacks
that exact tag. What was built is recorded in `<cache>/images/images.json` and
each cluster's `<state>/images.json`; clusterlib/transfer.py moves them into the nodes.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

from clusterlib import logs
from clusterlib.settings import Settings

REGISTRY = "ftjob.local"
PAUSE_TAG = "3.10"
BASE_PACKAGES = ("python3", "python3-venv", "python-is-python3", "ca-certificates")
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
IMAGE_CA_PATH = "/etc/ssl/certs/ftjob-build-host-ca.crt"  # mounted only while a RUN step runs, never in a layer
# Files whose content decides a Dockerfile image's tag (relative to the repo; folders are walked).
DOCKERFILE_INPUTS = ("pyproject.toml", "README.md", "operator", "trainer", "examples")


# The images a release publishes, by name: the Helm chart's `image.repository` default and the examples' image, each
# tagged with the project's version.
RELEASE_NAMES = {"operator": "ftjob-operator", "trainer": "ftjob-trainer"}


@dataclass(frozen=True)
class Image:
    name: str  # e.g. "trainer"
    ref: str  # the content-hashed reference
    dev_ref: str  # the stable alias the tests' manifests use
    release_ref: str | None = None  # the name a release gives it, as containerd spells it (None: not released)

    @property
    def aliases(self) -> tuple[str, ...]:
        """Every stable name a node's containerd carries for this build."""
        return (self.dev_ref,) if self.release_ref is None else (self.dev_ref, self.release_ref)

    def as_dict(self) -> dict[str, str]:
        out = {"ref": self.ref, "dev": self.dev_ref}
        if self.release_ref is not None:
            out["release"] = self.release_ref
        return out


def project_version(repo: Path) -> str:
    """The version in pyproject.toml: the tag of the released images (the Helm chart's appVersion matches it)."""
    return tomllib.loads((repo / "pyproject.toml").read_text())["project"]["version"]


def release_ref(name: str, version: str) -> str | None:
    """The released image's reference as a manifest writes it (e.g. `ftjob-trainer:0.1.0`); None for the images a
    release does not publish."""
    return f"{RELEASE_NAMES[name]}:{version}" if name in RELEASE_NAMES else None


def dockerfile_image(name: str, version: str, digest: str) -> Image:
    """The operator or trainer image of this version built from inputs hashing to `digest`, with its aliases."""
    released = release_ref(name, version)
    return Image(name, f"{REGISTRY}/ftjob-{name}:{version}-{digest}", f"{REGISTRY}/ftjob-{name}:dev",
                 containerd_name(released) if released else None)  # fmt: skip


def containerd_name(ref: str) -> str:
    """`ref` as the kubelet hands it to containerd (Docker's normalisation): a name without a registry host is on
    docker.io, and a single-component one under `library/`. Only a node image stored under this name satisfies a pod
    whose manifest says `ref`."""
    first, _, rest = ref.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        return ref
    return f"docker.io/{ref}" if rest else f"docker.io/library/{ref}"


def cache_dir(s: Settings) -> Path:
    return Path(s.cache_dir) / "images"


def buildah(s: Settings, *args: str) -> list[str]:
    store = cache_dir(s)
    return ["buildah", "--root", str(store / "storage"), "--runroot", str(store / "run"),
            "--storage-driver", "overlay", *args]  # fmt: skip


def _hash_paths(root: Path, rel_paths: tuple[str, ...], extra: str = "") -> str:
    h = hashlib.sha256(extra.encode())
    for rel in rel_paths:
        top = root / rel
        files = sorted(p for p in top.rglob("*") if p.is_file()) if top.is_dir() else [top] if top.exists() else []
        for f in files:
            parts = f.relative_to(root).parts
            if "__pycache__" in parts or f.suffix == ".pyc" or any(p.endswith(".egg-info") for p in parts):
                continue
            h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def image_exists(s: Settings, ref: str) -> bool:
    return subprocess.run(buildah(s, "inspect", "--type", "image", ref), capture_output=True).returncode == 0


def debian_mirror() -> str:
    """The Debian mirror apt already uses on this machine (never a host written into the project)."""
    for src in sorted(Path("/etc/apt/sources.list.d").glob("*.sources")):
        for block in src.read_text().split("\n\n"):
            if re.search(r"^Suites:.*\bbookworm\b", block, re.M) and "security" not in block:
                m = re.search(r"^URIs:\s*(\S+)", block, re.M)
                if m:
                    return m.group(1)
    legacy = Path("/etc/apt/sources.list")
    if legacy.exists():
        m = re.search(r"^deb\s+(\S+)\s+bookworm\s", legacy.read_text(), re.M)
        if m:
            return m.group(1)
    raise SystemExit("error: no Debian bookworm mirror found in /etc/apt/sources.list(.d); debootstrap needs one")


class Builder:
    """Builds what is missing, logging the tools' output to one file and printing progress lines."""

    def __init__(self, s: Settings, t0: float) -> None:
        self.s, self.t0 = s, t0
        self.log = logs.Logged(Path(s.cache_dir) / "logs" / "images.log", "images", t0)
        cache_dir(self.s).mkdir(parents=True, exist_ok=True)

    def pause(self) -> Image:
        ref = f"{REGISTRY}/pause:{PAUSE_TAG}-{_hash_paths(Path(self.s.bin_dir), ('pause',))}"
        image = Image("pause", ref, f"{REGISTRY}/pause:{PAUSE_TAG}")
        if not image_exists(self.s, ref):
            self.log.say(f"building {ref} (the pod sandbox)")
            ctr = self.log.run(buildah(self.s, "from", "scratch")).strip()
            try:
                self.log.run(buildah(self.s, "copy", "--chmod", "0755", ctr, f"{self.s.bin_dir}/pause", "/pause"))
                self.log.run(buildah(self.s, "config", "--entrypoint", '["/pause"]', "--user", "65535:65535", ctr))
                self.log.run(buildah(self.s, "commit", "--rm", ctr, ref))
            except BaseException:
                subprocess.run(buildah(self.s, "rm", ctr), capture_output=True)
                raise
        self._tag(image)
        return image

    def base(self) -> Image:
        recipe = "debootstrap minbase bookworm " + " ".join(BASE_PACKAGES)
        ref = f"{REGISTRY}/debian-python:bookworm-{hashlib.sha256(recipe.encode()).hexdigest()[:12]}"
        image = Image("base", ref, f"{REGISTRY}/debian-python:bookworm")
        if not image_exists(self.s, ref):
            self.log.say(f"building {ref}: debootstrap of Debian bookworm + python3 (about a minute)")
            with tempfile.TemporaryDirectory(dir=cache_dir(self.s)) as tmp:
                rootfs, tarball = Path(tmp) / "rootfs", Path(tmp) / "rootfs.tar"
                self.log.run(["debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}",
                              "bookworm", str(rootfs), debian_mirror()])  # fmt: skip
                for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
                    for p in (rootfs / junk).glob("*"):
                        if p.is_file():
                            p.unlink()
                # /dev, /proc and /sys come from the runtime; the image carries their empty folders only
                self.log.run(["tar", "-C", str(rootfs), "--exclude=./dev/*", "--exclude=./proc/*",
                              "--exclude=./sys/*", "-cf", str(tarball), "."])  # fmt: skip
                ctr = self.log.run(buildah(self.s, "from", "scratch")).strip()
                try:
                    self.log.run(buildah(self.s, "add", ctr, str(tarball), "/"))
                    path = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
                    self.log.run(buildah(self.s, "config", "--cmd", "/bin/bash", "--env", path, ctr))
                    self.log.run(buildah(self.s, "commit", "--rm", ctr, ref))
                except BaseException:
                    subprocess.run(buildah(self.s, "rm", ctr), capture_output=True)
                    raise
        self._tag(image)
        return image

    def dockerfile(self, name: str, base: Image) -> Image:
        repo = Path(self.s.repo)
        dockerfile = repo / "hack" / "images" / f"{name}.Dockerfile"
        digest = _hash_paths(repo, (str(dockerfile.relative_to(repo)), *DOCKERFILE_INPUTS), extra=base.ref)
        image = dockerfile_image(name, project_version(repo), digest)
        ref = image.ref
        if not image_exists(self.s, ref):
            self.log.say(f"building {ref} from {dockerfile.relative_to(repo)} (pip's cache is reused)")
            args = buildah(self.s, "bud", "--layers", "--isolation", "chroot", "--network", "host",
                           "-f", str(dockerfile), "-t", ref, "--build-arg", f"PYTHON_IMAGE={base.ref}")  # fmt: skip
            if HOST_CA_BUNDLE.exists():  # this machine may reach package indexes only through its own CA bundle
                args += ["-v", f"{HOST_CA_BUNDLE}:{IMAGE_CA_PATH}:ro", "--build-arg", f"PIP_CERT={IMAGE_CA_PATH}"]
            for var in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL"):
                if os.environ.get(var):
                    args += ["--build-arg", f"{var}={os.environ[var]}"]
            self.log.run([*args, str(repo)], heartbeat=f"building the {name} image")
        self._tag(image)
        return image

    def _tag(self, image: Image) -> None:
        self.log.run(buildah(self.s, "tag", image.ref, image.dev_ref))

    def diff_ids(self, image_id: str) -> set[str]:
        out = self.log.run(buildah(self.s, "inspect", "--type", "image", image_id))
        return set(json.loads(out)["OCIv1"]["rootfs"]["diff_ids"])

    def collect_garbage(self, current: list[Image]) -> None:
        """Delete images that are no longer current, and build-cache images holding a layer no current image has
        (old torch layers are GBs); the cache of the current images' steps stays."""
        keep = set().union(*(self.diff_ids(img.ref) for img in current))
        names = {img.ref for img in current} | {img.dev_ref for img in current}
        listing = json.loads(self.log.run(buildah(self.s, "images", "--all", "--json")) or "[]")
        stale = [e["id"] for e in listing if e.get("names") and not set(e["names"]) & names]
        stale += [e["id"] for e in listing if not e.get("names") and not self.diff_ids(e["id"]) <= keep]
        if stale:
            self.log.run(buildah(self.s, "rmi", "--force", *stale))

    def sizes(self) -> dict[str, str]:
        """Each local image's size as buildah reports it (e.g. "6.14 GB"), by reference."""
        listing = json.loads(self.log.run(buildah(self.s, "images", "--json")) or "[]")
        return {name: entry.get("size", "?") for entry in listing for name in entry.get("names") or []}


def build_all(s: Settings, t0: float) -> dict[str, Image]:
    """Build (or find cached) every image; record them; return them by name."""
    b = Builder(s, t0)
    started = time.monotonic()
    before = {r for r in b.sizes()}
    pause = b.pause()
    base = b.base()
    built = {"pause": pause, "base": base}
    for name in ("operator", "trainer"):
        if name in s.images.split(","):
            built[name] = b.dockerfile(name, base)
    if not {img.ref for img in built.values()} <= before:  # something was built: drop what it replaced
        b.collect_garbage(list(built.values()))
    sizes = b.sizes()
    record = {name: {**img.as_dict(), "size": sizes.get(img.ref, "?")} for name, img in built.items()}
    (cache_dir(s) / "images.json").write_text(json.dumps(record, indent=2) + "\n")
    listing = ", ".join(f"{name} {rec['size']}" for name, rec in record.items())
    b.log.say(f"images ready in {time.monotonic() - started:.0f}s: {listing}")
    return built


def remove_storage(s: Settings) -> None:
    """Unmount and delete buildah's storage (only for a throw-away cache)."""
    subprocess.run(buildah(s, "rm", "--all"), capture_output=True)
    shutil.rmtree(cache_dir(s), ignore_errors=True)
