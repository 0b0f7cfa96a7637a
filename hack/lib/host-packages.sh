#!/usr/bin/env bash
# Installs (once per machine) the Debian packages the local cluster's real nodes and image builds need:
# containerd + runc + the CNI plugins (the container runtime), iptables + conntrack (kube-proxy), buildah +
# debootstrap (the images), and the small tools the scripts call. apt's output goes to a log under the cache.
set -euo pipefail
CACHE=${FTJOB_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ftjob}
LOG=$CACHE/logs/host-packages.log
PACKAGES=(containerd runc containernetworking-plugins iptables conntrack buildah debootstrap util-linux iproute2 openssl)
say() { printf '[host-packages] %s\n' "$*" >&2; }

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} = 0 ] && exit 0
if [ "$(id -u)" != 0 ]; then
  say "missing Debian packages: ${missing[*]}; run as root (or install them) first"
  exit 1
fi
mkdir -p "$(dirname "$LOG")"
say "installing Debian packages: ${missing[*]} (apt's log: $LOG)"
# No init system starts the packaged containerd service here: each node runs its own containerd.
export DEBIAN_FRONTEND=noninteractive
if ! { apt-get update -q && apt-get install -y -q --no-install-recommends "${missing[@]}"; } >>"$LOG" 2>&1; then
  say "FAILED; last lines of $LOG:"
  tail -n 20 "$LOG" >&2
  exit 1
fi
say "installed ${missing[*]}"
