#!/usr/bin/env bash
# Creates (once per machine) the Python environment every ftjob command, test and pod uses, and installs this
# checkout into it in editable mode. torch is a multi-GB download: the venv lives in the user's cache directory,
# keyed by the dependency list, so fresh clones on the same machine reuse it instead of refetching.
#
# Callers capture it (`V=$(hack/lib/python-env.sh)`): standard output is exactly one line, the venv's path, on the
# cold path as on the warm one. Progress goes to standard error; pip's own output to a log under the cache.
# FTJOB_CACHE (default ~/.cache/ftjob) moves the cache, FTJOB_VENV the venv itself; FTJOB_PIP_EXTRAS (default
# trainer,test) picks the extras installed.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
CACHE=${FTJOB_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ftjob}
EXTRAS=${FTJOB_PIP_EXTRAS-trainer,test}
key=$( (sed -n '/^\[project\]/,/^\[tool/p' "$root/pyproject.toml"; echo "$EXTRAS") | sha256sum | cut -c1-12)
VENV=${FTJOB_VENV:-$CACHE/venv-$key}
LOG=$CACHE/logs/python-env.log
start=$(date +%s)
say() { printf '[python-env %4ds] %s\n' "$(( $(date +%s) - start ))" "$*" >&2; }

# Runs pip with its output in $LOG and a heartbeat line every 30 s; on failure the log's tail reaches the console.
pip_logged() {
  local what=$1; shift
  echo "==== $(date '+%F %T') $what: $*" >>"$LOG"
  "$VENV/bin/pip" "$@" >>"$LOG" 2>&1 &
  local pid=$! n=0
  while kill -0 "$pid" 2>/dev/null; do
    sleep 1; n=$((n + 1))
    [ $((n % 30)) = 0 ] && kill -0 "$pid" 2>/dev/null && say "still $what ..."
  done
  if ! wait "$pid"; then
    say "FAILED: $what; last lines of $LOG:"
    tail -n 25 "$LOG" >&2
    say "the whole log: $LOG"
    exit 1
  fi
}

if [ ! -f "$VENV/.complete" ]; then
  mkdir -p "$(dirname "$LOG")"
  say "creating $VENV (first time on this machine; torch is large); pip's log: $LOG"
  rm -rf "$VENV"
  python3.11 -m venv "$VENV" >&2
  pip_logged "upgrading pip" install --progress-bar off --upgrade pip setuptools wheel
  spec=$root${EXTRAS:+[$EXTRAS]}
  say "installing ftjob${EXTRAS:+[$EXTRAS]} and its dependencies"
  pip_logged "installing dependencies" install --progress-bar off -e "$spec"
  touch "$VENV/.complete"
  say "python environment ready"
fi
# Re-point the editable install at this checkout when any package of pyproject's mapping resolves elsewhere (another
# checkout, or a mapping that changed since the install); cheap: no dependency is fetched.
points_here='
import importlib.util, os, sys, tomllib
root = sys.argv[1]
with open(os.path.join(root, "pyproject.toml"), "rb") as f:
    mapping = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
for name, folder in mapping.items():  # found, not imported: no package code (torch) runs
    spec, folder = importlib.util.find_spec(name), os.path.join(root, folder)
    if spec is None or os.path.realpath(list(spec.submodule_search_locations)[0]) != os.path.realpath(folder):
        sys.exit(1)
    if os.path.exists(os.path.join(folder, "__init__.py")) != (spec.origin not in (None, "namespace")):
        sys.exit(1)  # installed when the folder was (not) a namespace package
'
if ! "$VENV/bin/python" -c "$points_here" "$root" 2>/dev/null; then
  mkdir -p "$(dirname "$LOG")"
  pip_logged "installing this checkout" install --progress-bar off --no-deps -e "$root"
fi
echo "$VENV"
