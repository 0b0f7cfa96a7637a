"""Running the tools the cluster needs (buildah, debootstrap, ctr, ...) quietly: their output goes to a log file,
the console gets one progress line per step (and a heartbeat on long ones), and a failure shows the log's tail."""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path


class Logged:
    def __init__(self, log: Path, prefix: str, t0: float) -> None:
        self.path, self.prefix, self.t0 = log, prefix, t0
        log.parent.mkdir(parents=True, exist_ok=True)

    def say(self, msg: str) -> None:
        print(f"[{self.prefix} {time.monotonic() - self.t0:5.1f}s] {msg}", flush=True)

    def run(self, argv: list[str], heartbeat: str | None = None, env: dict[str, str] | None = None) -> str:
        """Run `argv`; its stderr (and stdout, which is also returned) are appended to the log."""
        with open(self.path, "a") as log:
            log.write(f"\n==== {time.strftime('%F %T')} {' '.join(argv)}\n")
            log.flush()
            done = threading.Event()
            if heartbeat:
                threading.Thread(target=self._beat, args=(heartbeat, done), daemon=True).start()
            try:
                proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
            finally:
                done.set()
            log.write(proc.stdout[-20000:])
        if proc.returncode != 0:
            tail = "".join(self.path.read_text(errors="replace").splitlines(True)[-25:])
            raise SystemExit(f"error: `{' '.join(argv[:6])} ...` failed ({proc.returncode}); "
                             f"last lines of {self.path}:\n{tail}")  # fmt: skip
        return proc.stdout

    def _beat(self, what: str, done: threading.Event) -> None:
        while not done.wait(30):
            self.say(f"still {what} ...")
