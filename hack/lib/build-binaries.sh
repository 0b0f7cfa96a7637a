#!/usr/bin/env bash
# Builds (once per machine, cached by version) the binaries hack/cluster runs: kube-apiserver,
# kube-controller-manager, kube-scheduler, kubelet, kube-proxy and etcd from the Go module proxy; CoreDNS and helm
# with `go install`; the nodes' pause and fake-GPU device plugin from hack/nodetools (cached by source hash).
# k8s.io/kubernetes replaces its staging modules with ./staging/..., which `go install pkg@version` refuses, so we
# build inside a throw-away wrapper module that pins each staging module to its published v0.X.Y twin.
set -euo pipefail

K8S_VERSION=${FTJOB_K8S_VERSION:-v1.36.3}
ETCD_VERSION=${FTJOB_ETCD_VERSION:-v3.6.16}
HELM_VERSION=${FTJOB_HELM_VERSION:-v3.22.0}
COREDNS_VERSION=${FTJOB_COREDNS_VERSION:-v1.14.7}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
CACHE=${FTJOB_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ftjob}
BIN=$CACHE/bin/k8s-$K8S_VERSION
# The Go toolchain's chatter (hundreds of `go: downloading ...` lines) goes here, not to the console.
BUILD_LOG=$CACHE/logs/build-binaries.log
export CGO_ENABLED=0 GOFLAGS=-mod=mod GOTOOLCHAIN=local
[ "${1:-all}" = dir ] || mkdir -p "$BIN" "$(dirname "$BUILD_LOG")"

start=$(date +%s)
log() { printf '[build %4ds] %s\n' "$(( $(date +%s) - start ))" "$*" >&2; }

# Runs a long command with its output appended to $BUILD_LOG, printing a heartbeat line every 30 s so a cold build
# never looks hung; on failure the log's tail and path reach the console.
with_progress() {
  local what=$1; shift
  echo "==== $(date '+%F %T') $what: $*" >>"$BUILD_LOG"
  "$@" >>"$BUILD_LOG" 2>&1 &
  local pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    kill -0 "$pid" 2>/dev/null && log "still building $what ..."
  done
  if ! wait "$pid"; then
    log "FAILED: $what; last lines of $BUILD_LOG:"
    tail -n 25 "$BUILD_LOG" >&2
    log "the whole log: $BUILD_LOG"
    return 1
  fi
}

# The .mod file the module proxy serves for MODULE@VERSION (downloaded into Go's module cache).
mod_file() {
  local work=$1 module=$2 out
  out=$(cd "$work" && go mod download -json "$module" 2>>"$BUILD_LOG") || {
    log "FAILED: go mod download $module; see $BUILD_LOG"; tail -n 25 "$BUILD_LOG" >&2; return 1; }
  printf '%s\n' "$out" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p'
}

build_kubernetes() {
  local want=(kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy) missing=0
  for b in "${want[@]}"; do [ -x "$BIN/$b" ] || missing=1; done
  [ $missing = 1 ] || return 0
  log "building Kubernetes $K8S_VERSION (first time on this machine: expect many minutes on 2 cores)"
  local work=$CACHE/src/k8s-wrapper-$K8S_VERSION
  mkdir -p "$work"
  local modfile
  modfile=$(mod_file "$work" "k8s.io/kubernetes@$K8S_VERSION")
  local minor=${K8S_VERSION#v1.}; local staging_version=v0.$minor
  {
    echo "module ftjob.local/k8s-wrapper"
    echo
    echo "go 1.26"
    echo
    echo "require k8s.io/kubernetes $K8S_VERSION"
    echo
    # every `k8s.io/x => ./staging/src/k8s.io/x` of kubernetes' go.mod becomes `k8s.io/x => k8s.io/x v0.X.Y`
    sed -n 's#^\s*\(k8s.io/[a-z0-9-]*\) => ./staging/src/k8s.io/[a-z0-9-]*#\1#p' "$modfile" |
      while read -r m; do echo "replace $m => $m $staging_version"; done
  } >"$work/go.mod"
  cat >"$work/tools.go" <<'GO'
//go:build tools

package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubelet"
	_ "k8s.io/kubernetes/cmd/kube-proxy"
)
GO
  log "resolving modules (go: downloading ... goes to $BUILD_LOG)"
  (cd "$work" && go mod tidy -e >>"$BUILD_LOG" 2>&1 || true)
  local major=1 minor_num=${minor%%.*}
  local ld="-s -w"
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ld="$ld -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor_num"
    ld="$ld -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
  done
  for b in "${want[@]}"; do
    [ -x "$BIN/$b" ] && continue
    log "go build $b"
    (cd "$work" && with_progress "$b" go build -trimpath -ldflags "$ld" -o "$BIN/$b.tmp" "k8s.io/kubernetes/cmd/$b")
    mv "$BIN/$b.tmp" "$BIN/$b"
    log "built $b"
  done
}

build_etcd() {
  [ -x "$BIN/etcd" ] && return 0
  log "building etcd $ETCD_VERSION"
  local work=$CACHE/src/etcd-wrapper-$ETCD_VERSION
  mkdir -p "$work"
  local modfile
  modfile=$(mod_file "$work" "go.etcd.io/etcd/server/v3@$ETCD_VERSION")
  {
    echo "module ftjob.local/etcd-wrapper"
    echo
    echo "go 1.26"
    echo
    echo "require go.etcd.io/etcd/server/v3 $ETCD_VERSION"
    sed -n 's#^\s*\(go.etcd.io/etcd/[a-z0-9/]*\) => \.\./.*#\1#p' "$modfile" |
      while read -r m; do echo "replace $m => $m $ETCD_VERSION"; done
  } >"$work/go.mod"
  printf '//go:build tools\n\npackage tools\n\nimport _ "go.etcd.io/etcd/server/v3"\n' >"$work/tools.go"
  (cd "$work" && go mod tidy -e >>"$BUILD_LOG" 2>&1 || true)
  (cd "$work" && with_progress etcd go build -trimpath -ldflags "-s -w" -o "$BIN/etcd.tmp" go.etcd.io/etcd/server/v3)
  mv "$BIN/etcd.tmp" "$BIN/etcd"
  log "built etcd"
}

build_helm() {
  [ -x "$BIN/helm" ] && return 0
  log "building helm $HELM_VERSION"
  GOBIN=$BIN.helm-tmp with_progress helm go install -trimpath \
    -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION" "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
  mv "$BIN.helm-tmp/helm" "$BIN/helm" && rmdir "$BIN.helm-tmp"
  log "built helm"
}

build_coredns() {
  [ -x "$BIN/coredns" ] && return 0
  log "building CoreDNS $COREDNS_VERSION"
  GOBIN=$BIN.coredns-tmp with_progress coredns go install -trimpath -ldflags "-s -w" \
    "github.com/coredns/coredns@$COREDNS_VERSION"
  mv "$BIN.coredns-tmp/coredns" "$BIN/coredns" && rmdir "$BIN.coredns-tmp"
  log "built coredns"
}

# Our own node tools (hack/nodetools): rebuilt whenever their sources change.
build_nodetools() {
  local src=$ROOT/hack/nodetools hash
  hash=$(cd "$src" && find . -type f \( -name '*.go' -o -name 'go.mod' -o -name 'go.sum' \) -print0 | sort -z |
    xargs -0 sha256sum | sha256sum | cut -c1-16)
  [ "$(cat "$BIN/nodetools.hash" 2>/dev/null)" = "$hash" ] && [ -x "$BIN/pause" ] && [ -x "$BIN/fake-gpu-plugin" ] &&
    return 0
  log "building the node tools (pause, fake-gpu-plugin) from hack/nodetools"
  (cd "$src" && with_progress nodetools go build -trimpath -ldflags "-s -w" -o "$BIN/" ./cmd/pause ./cmd/fake-gpu-plugin)
  echo "$hash" >"$BIN/nodetools.hash"
}

case "${1:-all}" in
  all) build_etcd; build_kubernetes; build_coredns; build_nodetools; build_helm ;;
  kubernetes) build_kubernetes ;;
  etcd) build_etcd ;;
  helm) build_helm ;;
  coredns) build_coredns ;;
  nodetools) build_nodetools ;;
  dir) echo "$BIN" ;;
  *) echo "usage: $0 [all|kubernetes|etcd|helm|coredns|nodetools|dir]" >&2; exit 2 ;;
esac
log "binaries ready in $BIN"
