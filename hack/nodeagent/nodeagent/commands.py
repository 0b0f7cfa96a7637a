"""What a container runs. Images are never pulled: the image name only picks a default command.

- `command` (+ `args`) given: run exactly that, with the project's Python env first on PATH (`python` is the venv's).
- no `command`: the image name decides the entrypoint, then `args` follow:
    * an image whose name contains `ftjob-trainer`  -> `ftjob-trainer`
    * an image whose name contains `ftjob-operator` -> `ftjob-operator`
    * anything else (python, busybox, ...) needs an explicit command: the container fails with reason `NoCommand`.
- `$(VAR)` in command/args expands to the container's env var VAR (as in Kubernetes); `$$(VAR)` stays literal.
"""

from __future__ import annotations

import re

IMAGE_ENTRYPOINTS = {"ftjob-trainer": ["ftjob-trainer"], "ftjob-operator": ["ftjob-operator"]}


class NoCommandError(ValueError):
    """The container has no command and its image maps to no entrypoint."""


_VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand_refs(text: str, env: dict[str, str]) -> str:
    """Kubernetes `$(VAR)` expansion: known vars expand, unknown ones stay as written, `$$` escapes a `$`."""

    def repl(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _VAR_REF.sub(repl, text)


def container_argv(container: dict, env: dict[str, str]) -> list[str]:
    command = container.get("command")
    args = container.get("args") or []
    if not command:
        image = container.get("image", "")
        entry = next((argv for key, argv in IMAGE_ENTRYPOINTS.items() if key in image), None)
        if entry is None:
            raise NoCommandError(
                f"container {container.get('name')!r}: image {image!r} has no known entrypoint on this node agent; "
                "set `command` (images whose name contains ftjob-trainer/ftjob-operator run those entrypoints)"
            )
        command = entry
    return [expand_refs(str(a), env) for a in [*command, *args]]
