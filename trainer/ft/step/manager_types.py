"""The Manager's small types: what a step's quorum tells a rank, and why the Manager gives up."""

from __future__ import annotations

from dataclasses import dataclass

from ftjob import contract
from ftjob.contract.lighthouse_api import QuorumResponse
from pydantic import BaseModel


@dataclass(frozen=True)
class QuorumInfo:
    """This rank's view of the step it is about to train."""

    quorum_id: int
    step: int  # the step this quorum trains (== manager.step after any healing)
    contributing: bool  # False for a spare or a healing group: it sends zero gradients and is not counted
    contributor_rank: int  # index among contributing groups (for data sharding); -1 when not contributing
    num_contributors: int  # gradient divisor / number of data shards this step
    participants: int  # groups in the quorum (contributing or not)
    healed: bool  # this call copied state from a peer


class QuorumUnavailable(RuntimeError):
    """No quorum within quorum_timeout_s (lighthouse unreachable or too few groups): the process should exit."""


class InitialSyncError(RuntimeError):
    """Copying the reference group's state at step 0 failed: this group exits (it would train its own weights)."""


class StateLostError(RuntimeError):
    """A failed heal left this group's state partly copied (received in place) and no peer is ahead to heal from:
    the group exits rather than train or serve a torn state (its replacement restores the job's checkpoint)."""


class Terminated(SystemExit):
    """This process was asked to terminate (SIGTERM: its pod is deleted or evicted) and its group left the job at a
    step boundary (ftjob.ft.step.termination). A SystemExit, so the interpreter exits with contract.EXIT_TERMINATED
    (143) through ``finally`` blocks and atexit, and no ``except Exception`` in a training loop holds it up: never with
    0, which the operator would take for the group having finished training."""

    def __init__(self, message: str) -> None:
        super().__init__(contract.EXIT_TERMINATED)
        self.message = message

    def __str__(self) -> str:
        return self.message


class GroupAnswer(BaseModel):
    """What rank 0 tells the other ranks of its group after asking the lighthouse."""

    quorum: QuorumResponse | None = None
    error: str | None = None
    evicted: bool = False
    leaving: bool = False  # SIGTERM came while rank 0 waited for the quorum: the group leaves now
