"""The one way a test waits: a predicate polled with a deadline, never a bare sleep."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class StopWaiting(AssertionError):
    """Raised by a predicate when waiting longer cannot help (the process it waits on has exited): `wait_for` fails
    at once with it instead of counting it as "not yet"."""


def wait_for(
    predicate: Callable[[], T],
    timeout: float,
    what: str,
    interval: float = 0.2,
    describe: Callable[[], object] | None = None,
) -> T:
    """Poll ``predicate`` every ``interval`` seconds until it returns something truthy, and return that; fail after
    ``timeout`` seconds with an AssertionError naming ``what`` was awaited and the last value seen.

    An exception inside the predicate counts as "not yet" (the API may be briefly unavailable) and is reported as the
    last value, except `StopWaiting`, which fails at once; ``describe``, if given, adds more of the state (e.g. pod
    phases and events) to the failure message.
    """
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            value = predicate()
            if value:
                return value
            last = value
        except StopWaiting:
            raise
        except Exception as e:  # a transient error is a "not yet", never a pass
            last = e
        if time.monotonic() >= deadline:
            context = ""
            if describe is not None:
                try:
                    context = f"; state: {describe()}"
                except Exception as e:
                    context = f"; describing the state failed: {e!r}"
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}; last seen: {last!r}{context}")
        time.sleep(interval)  # the poll interval of a deadline loop, not synchronisation
