"""The floor under a rejoin in hack/bench/bench_failover.py: what the bench's restarted worker
(tests/support/manager_worker.py: two nn.Linear(WIDTH, WIDTH), Adam; the bench passes its WIDTH) costs with
torch alone, no fault tolerance at all. It imports torch, builds the same model and optimizer (torch.optim imports
torch._dynamo, ~900 modules), trains one local step and prints one JSON line with the times of each, on the same
clock as the bench's spawn time. No library can start a rank faster than this; what ftjob's restarted process takes
beyond it is ftjob's own cost.

    python hack/bench/torch_floor.py [WIDTH]   # -> {"boot": ..., "imported": ..., "built": ..., "stepped": ...}
"""

from __future__ import annotations

import json
import sys
import time

BOOT = time.time()  # interpreter up

import torch  # noqa: E402

IMPORTED = time.time()


def main(width: int) -> int:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, width))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    built = time.time()
    x = torch.randn(8, width, generator=torch.Generator().manual_seed(0))
    (model(x) - x.flip(1)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    stepped = time.time()
    print(json.dumps({"boot": BOOT, "imported": IMPORTED, "built": built, "stepped": stepped}))
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 64))
