"""A quorum's answers to its members, cheap at 12,500 groups: most of a QuorumResponse is the same for every member
(quorum id, step, the store's per-rank addresses -- 64 of them for 64-rank groups), so that part is JSON-encoded once
per quorum and each member's answer is its few own fields spliced in front of it. A pydantic QuorumResponse is built
only when someone reads one (tests, ``want_members``); ``encoded`` gives the same JSON a QuorumResponse would."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ftjob.contract.lighthouse_api import QuorumResponse, RecoverySource


@dataclass(frozen=True, slots=True)
class Own:
    """The fields of one member's answer that differ between members."""

    replica_rank: int
    contributing: bool
    contributor_rank: int
    recover_from: RecoverySource | None
    serve_recovery: bool


def _flag(value: bool) -> str:
    return "true" if value else "false"


class Answers(Mapping[str, QuorumResponse]):
    """group -> its QuorumResponse (built on access); ``encoded(group)``: its JSON body, without building it."""

    def __init__(self, shared: dict[str, Any], own: dict[str, Own]) -> None:
        self._shared = shared  # QuorumResponse's fields common to every member
        self._own = own
        self._tail = json.dumps(shared, separators=(",", ":"))[1:]  # '"quorum_id":3,...}'

    def __getitem__(self, group: str) -> QuorumResponse:
        own = self._own[group]
        return QuorumResponse(
            **self._shared,
            replica_rank=own.replica_rank,
            contributing=own.contributing,
            contributor_rank=own.contributor_rank,
            heal=own.recover_from is not None,
            recover_from=own.recover_from,
            serve_recovery=own.serve_recovery,
        )

    def __iter__(self) -> Iterator[str]:
        return iter(self._own)

    def __len__(self) -> int:
        return len(self._own)

    def encoded(self, group: str) -> bytes:
        """The member's answer as JSON (None fields left out, as the server sends it)."""
        own = self._own[group]
        source = own.recover_from
        heal = f'"heal":true,"recover_from":{source.model_dump_json()},' if source is not None else '"heal":false,'
        return (
            f'{{"replica_rank":{own.replica_rank},"contributing":{_flag(own.contributing)},'
            f'"contributor_rank":{own.contributor_rank},{heal}"serve_recovery":{_flag(own.serve_recovery)},'
            f"{self._tail}"
        ).encode()
