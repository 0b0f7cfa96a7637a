"""A rank's start-up without CPython's full garbage collections over torch.

Starting a rank builds one of the largest heaps a Python program has: ``import torch`` leaves a great many objects
the cyclic collector tracks, and the first optimizer imports ``torch._dynamo`` (hundreds more modules; every torch
optimizer does, torchft's too). Each full collection while that happens scans all of it, and CPython runs several
while a rank starts: CPU spent before a replacement rank's first step, while the others wait for it to rejoin. Those
objects are modules, classes and functions: they live as long as the process.

So when the library loads (``import ftjob.ft``, and again once the Manager's own dependencies are in), everything
alive is frozen (``gc.freeze``): reference counting still frees a frozen object, the collector just stops scanning
it. What the training script creates afterwards is collected as usual. At exit everything is unfrozen again, so the
interpreter's last collection frees it as it would have (native extensions such as triton's check that theirs were).

FTJOB_GC_FREEZE=0 leaves the collector alone.
"""

from __future__ import annotations

import atexit
import gc

from ftjob import contract

_unfreeze_at_exit = False


def freeze_loaded() -> bool:
    """Freezes what is alive now (see the module doc); returns whether it did (FTJOB_GC_FREEZE=0: not)."""
    global _unfreeze_at_exit
    if contract.switched_off(contract.ENV_GC_FREEZE):
        return False
    gc.freeze()  # O(1): it moves the collector's lists, it scans nothing
    if not _unfreeze_at_exit:
        atexit.register(gc.unfreeze)
        _unfreeze_at_exit = True
    return True
