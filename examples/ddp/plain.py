"""The README's plain DDP loop (plain.py, run with `torchrun --nproc-per-node 2 examples/ddp/plain.py`) and the same
loop made fault tolerant with ftjob (fault_tolerant.py: `ftjob-trainer launch --replicas 3 --kill-at 20 -- python
examples/ddp/fault_tolerant.py`, or examples/k8s/ddp.yaml). `diff plain.py fault_tolerant.py`: only setup lines
change (and the closing destroy_process_group, which ftjob does at exit).
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

gen = torch.Generator().manual_seed(0)
inputs = torch.randn(8192, 16, generator=gen)
dataset = TensorDataset(inputs, (inputs.sum(dim=1) > 0).long())

dist.init_process_group("gloo")
model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 2)))
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=20, gamma=0.5)
loader = DataLoader(dataset, batch_size=32, sampler=DistributedSampler(dataset))

for x, y in loader:
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    scheduler.step()

dist.destroy_process_group()  # without it gloo threads may abort the exit (SIGABRT); ftjob does this at exit
