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
# Re-point the editable install at this checkout (cheap: no dependency is fetched).
if ! "$VENV/bin/python" -c 'import ftjob.operator, sys, os; sys.exit(0 if os.path.realpath(ftjob.operator.__path__[0]) == os.path.realpath(sys.argv[1]) else 1)' "$root/operator" 2>/dev/null; then
  mkdir -p "$(dirname "$LOG")"
  pip_logged "installing this checkout" install --progress-bar off --no-deps -e "$root"
fi
echo "$VENV"
