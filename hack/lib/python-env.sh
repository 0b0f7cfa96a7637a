#!/usr/bin/env bash
# Creates (once per machine) the Python environment every ftjob command, test and pod uses, and installs this
# checkout into it in editable mode. torch is a multi-GB download: the venv lives in the user's cache directory,
# keyed by the dependency list, so fresh clones on the same machine reuse it instead of refetching.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
CACHE=${FTJOB_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ftjob}
key=$(sed -n '/^\[project\]/,/^\[tool/p' "$root/pyproject.toml" | sha256sum | cut -c1-12)
VENV=${FTJOB_VENV:-$CACHE/venv-$key}
if [ ! -f "$VENV/.complete" ]; then
  echo "[python-env] creating $VENV (first time on this machine; torch is large)" >&2
  python3.11 -m venv "$VENV"
  "$VENV/bin/pip" install --progress-bar off -q --upgrade pip setuptools wheel
  "$VENV/bin/pip" install --progress-bar off -e "$root[trainer,test]"
  touch "$VENV/.complete"
fi
# Re-point the editable install at this checkout (cheap: no dependency is fetched).
if ! "$VENV/bin/python" -c 'import ftjob.operator, sys, os; sys.exit(0 if os.path.realpath(ftjob.operator.__path__[0]) == os.path.realpath(sys.argv[1]) else 1)' "$root/operator" 2>/dev/null; then
  "$VENV/bin/pip" install --progress-bar off -q --no-deps -e "$root" >&2
fi
echo "$VENV"
