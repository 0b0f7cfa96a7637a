"""The drop-in wrappers a training loop uses: DistributedDataParallel, Optimizer/LRScheduler/GradScaler, DataLoader,
shards."""
