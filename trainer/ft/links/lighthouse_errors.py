"""What a lighthouse refusal or a lost lighthouse looks like to its client: the error types the training thread sees,
and the decoding of an HTTP answer into its model or the error it stands for."""

from __future__ import annotations

from typing import TypeVar

import aiohttp
from ftjob.contract.lighthouse_api import Answer, ErrorResponse
from pydantic import ValidationError

A = TypeVar("A", bound=Answer)


class LighthouseLost(ConnectionError):
    """The watch socket dropped while this request was in flight: the lighthouse is gone or restarting."""


class LighthouseError(RuntimeError):
    """The lighthouse refused a request (``status`` is its HTTP status) or answered something unreadable."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"lighthouse answered {status}: {message}")
        self.status = status


class LighthouseTlsError(LighthouseError):
    """TLS with the lighthouse failed (its certificate is not the job's, or it speaks plain HTTP): never retried."""

    def __init__(self, message: str) -> None:
        RuntimeError.__init__(self, message)
        self.status = 0


class EvictedError(LighthouseError):
    """This process's incarnation was evicted: it must exit (a restarted process gets a new incarnation)."""


async def decode(resp: aiohttp.ClientResponse, answer: type[A]) -> A:
    """The answer's model; a 4xx/5xx raises what it means (410: EvictedError), with the lighthouse's message."""
    raw = await resp.read()
    if resp.status >= 400:
        try:
            error = ErrorResponse.model_validate_json(raw).error
        except ValidationError:
            error = raw.decode(errors="replace")
        cls = EvictedError if resp.status == 410 else LighthouseError
        raise cls(resp.status, error)
    try:
        return answer.model_validate_json(raw)
    except ValidationError as e:
        raise LighthouseError(resp.status, f"unreadable {answer.__name__}: {e}") from None
