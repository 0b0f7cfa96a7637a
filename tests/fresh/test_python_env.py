"""hack/lib/python-env.sh is captured by every caller (`V=$(hack/lib/python-env.sh)`): its standard output must be
exactly one line, the path of a usable venv, on the cold path (nothing cached) as on the warm one. Everything else
(pip's output, progress) goes elsewhere; a fresh machine broke on exactly this once."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.support.paths import REPO

SCRIPT = REPO / "hack" / "lib" / "python-env.sh"


def _run(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(SCRIPT)], capture_output=True, text=True, env=env, timeout=900)


def test_stdout_is_one_line_naming_the_venv_cold_and_warm(tmp_path: Path) -> None:
    env = dict(os.environ)
    env.update(
        FTJOB_CACHE=str(tmp_path / "cache"),  # an empty cache: the cold path
        FTJOB_VENV=str(tmp_path / "venv"),
        FTJOB_PIP_EXTRAS="",  # the same script and steps, without downloading torch again
    )
    cold = _run(env)
    assert cold.returncode == 0, cold.stderr[-3000:]
    assert cold.stdout.splitlines() == [str(tmp_path / "venv")], f"stdout must be the venv path alone: {cold.stdout!r}"
    assert "python-env" in cold.stderr, "the cold path must say what it is doing (on stderr)"
    assert (tmp_path / "cache" / "logs" / "python-env.log").stat().st_size > 0, "pip's output belongs in the log"
    python = tmp_path / "venv" / "bin" / "python"
    probe = subprocess.run([str(python), "-c", "import ftjob.operator, kopf; print('ok')"], capture_output=True,
                           text=True)  # fmt: skip
    assert probe.stdout.strip() == "ok", probe.stderr

    warm = _run(env)
    assert warm.returncode == 0, warm.stderr[-3000:]
    assert warm.stdout.splitlines() == [str(tmp_path / "venv")], warm.stdout
