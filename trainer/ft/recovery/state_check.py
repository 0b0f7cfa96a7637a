"""Checks that a state dict can travel to a healing peer, before anyone needs it to.

A group's state dict is what live recovery copies (and what checkpoints hold beyond the model and optimizer). A value
recovery cannot carry must fail the group that holds it, when it is built or when its state changes shape, with a
message naming the entry: never a healthy peer later, in the middle of serving a heal.
"""

from __future__ import annotations

from typing import Any

from ftjob.ft.recovery.codec import CodecError, encode


class StateDictError(ValueError):
    """This group's state dict holds something live recovery cannot carry; the message says what and how to fix it."""


FIX_HINT = (
    "state dicts may hold tensors, dicts (str or int keys), lists, tuples, str, int, float, bool and None; convert "
    "anything else (a numpy array: torch.from_numpy(a); numpy/random RNG state: keep the RNG in a torch.Generator and "
    "save generator.get_state())"
)


def check_state_dict(state: Any, who: str) -> None:
    """Raises StateDictError when ``state`` cannot be sent to a healing peer (walks it; copies nothing)."""
    try:
        encode(state)
    except CodecError as e:
        raise StateDictError(f"{who}: state_dict() cannot be sent to a healing peer: {e}. {FIX_HINT}") from None
