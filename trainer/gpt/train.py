"""``ftjob-trainer train``: the reference GPT training loop on top of the fault-tolerant Manager.

Per step: join the quorum (healing from a peer if behind), train this group's shard of the step's samples, average
gradients across contributing groups, and step the optimizer only if the whole quorum commits. The data cursor is
part of the state the Manager copies to a healing group and of every checkpoint, so no sample is dropped or repeated.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from ftjob import contract
from ftjob.ft.integrity.digest import digest_of, full_params, replica_tensors
from ftjob.ft.records import CommitRecord, FinishedRecord, GroupLog, StartRecord, group_log_path
from ftjob.gpt.config import TrainConfig
from ftjob.gpt.data import Corpus, SampleSource, rank_range, shard_range
from ftjob.gpt.model import build_model, count_params

if TYPE_CHECKING:
    from ftjob.ft import checkpoint
from torch import nn


@dataclass
class DataState:
    cursor: int = 0  # global index of the first sample of the next step


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    # foreach=False: the same per-tensor arithmetic everywhere, so replicas stay bitwise identical.
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0, foreach=False)


def lr_at(step: int, cfg: TrainConfig) -> float:
    return cfg.lr * min(1.0, (step + 1) / max(cfg.warmup_steps, 1))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def forward_backward(model: nn.Module, source: SampleSource, start: int, count: int) -> float:
    """Loss on global samples ``[start, start+count)``; gradients accumulate into ``.grad``."""
    x, y = source.samples(start, count)
    device = next(model.parameters()).device
    _, loss = model(x.to(device), y.to(device))
    assert loss is not None
    loss.backward()
    return float(loss.detach())


def ensure_zero_grads(params: list[nn.Parameter]) -> None:
    """A non-contributing group sends zeros: every parameter needs a (zero) gradient tensor."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        else:
            p.grad.zero_()


def thread_cpu_seconds() -> dict[str, float]:
    """CPU seconds (user + system) so far of this process ("process", ended threads included) and of each live
    thread, by name (Python's thread name, else the kernel's; threads of one name summed): where a rank's CPU goes."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    times = os.times()
    out: dict[str, float] = {"process": times.user + times.system}
    for tid in os.listdir("/proc/self/task"):
        task = Path("/proc/self/task", tid)
        try:
            stat, comm = (task / "stat").read_text(), (task / "comm").read_text().strip()
        except OSError:  # the thread ended meanwhile
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after the command name: state is field 3, utime 14, stime 15
        name = names.get(int(tid), comm)
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


class CpuMeter:
    """Per-thread CPU seconds per step from the end of the first step on (start-up and imports excluded), for the
    benches' CPU breakdown."""

    def __init__(self) -> None:
        self._first: dict[str, float] | None = None
        self._steps = 0

    def step_done(self) -> None:
        if self._first is None:
            self._first = thread_cpu_seconds()
        else:
            self._steps += 1

    def per_step(self) -> dict[str, float]:
        now = thread_cpu_seconds()
        first = self._first or {}
        n = max(self._steps, 1)
        per_step = {k: (v - first.get(k, 0.0)) / n for k, v in now.items()}
        return {**per_step, "process_life": now["process"]}  # and the whole life's, start-up included


def shard_model(model: nn.Module) -> nn.Module:
    """FSDP2 inside the group: each block and the root sharded over the group's ranks."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


class Trainer:
    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.incarnation = uuid.uuid4().hex[:12]
        torch.set_num_threads(cfg.threads)
        self.device = torch.device(cfg.device)
        if self.device.type == "cuda":  # untested here (no GPU on the dev machine); one GPU per rank
            torch.cuda.set_device(int(os.environ.get(contract.ENV_LOCAL_RANK, "0")))
            self.device = torch.device("cuda", torch.cuda.current_device())
        if cfg.world_size > 1 and not dist.is_initialized():
            dist.init_process_group(
                "nccl" if self.device.type == "cuda" else "gloo",
                init_method=f"tcp://{cfg.master_addr}:{cfg.master_port}",
                rank=cfg.rank,
                world_size=cfg.world_size,
            )
        self.model = build_model(cfg.model, cfg.seed).to(self.device)  # same CPU init everywhere, then moved
        self.n_params = count_params(self.model)
        if cfg.world_size > 1:
            shard_model(self.model)
        self.params = list(self.model.parameters())
        self.optimizer = make_optimizer(self.model, cfg)
        self.corpus = Corpus.load(cfg.corpus_root, cfg.corpus_bytes)
        self.source = SampleSource(self.corpus, self.model.cfg.block_size)
        self.data = DataState()
        self.cpu = CpuMeter()
        self.log = GroupLog(group_log_path(cfg.run_dir, cfg.group)) if cfg.run_dir and cfg.rank == 0 else None
        self.ckpt: checkpoint.AsyncCheckpointer | None = None
        self._ckpt_pg: Any = None
        if cfg.checkpoint_dir is not None:
            from ftjob.ft import checkpoint  # dcp is slow to import: only when checkpointing

            # A dedicated gloo group: dcp's background collectives must not interleave with FSDP's on the default one.
            self._ckpt_pg = dist.new_group(backend="gloo") if cfg.world_size > 1 else None
            self.ckpt = checkpoint.AsyncCheckpointer(
                cfg.checkpoint_dir, cfg.group, cfg.keep_checkpoints, rank=cfg.rank, process_group=self._ckpt_pg
            )

    # --- state the Manager copies to a healing peer -----------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optim": self.optimizer.state_dict(),
            "data": {"cursor": self.data.cursor},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optim"])
        self.data.cursor = int(state["data"]["cursor"])

    # --- durable checkpoints ------------------------------------------------------------------------------------
    def _checkpoint_state(self, step: int) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {
            "model": model_sd,
            "optim": optim_sd,
            "data": {"cursor": torch.tensor(self.data.cursor), "step": torch.tensor(step)},
        }

    def resume(self) -> int:
        """Load the newest intact checkpoint of any group; returns its step (0 when there is none)."""
        if self.cfg.checkpoint_dir is None:
            return 0
        from ftjob.ft import checkpoint

        found = checkpoint.newest_intact(self.cfg.checkpoint_dir)
        if found is None:
            return 0
        for why in found.skipped:
            self._say(f"checkpoint skipped: {why}")
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = self._checkpoint_state(0)
        checkpoint.load(found, state, process_group=self._ckpt_pg)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self.data.cursor = int(state["data"]["cursor"])
        step = int(state["data"]["step"])
        self._say(f"resumed from {found.path} at step {step} (cursor {self.data.cursor})")
        return step

    # --- the loop -----------------------------------------------------------------------------------------------
    def _say(self, msg: str) -> None:
        if self.cfg.rank == 0:
            print(f"[group {self.cfg.group}] {msg}", flush=True)

    def run(self) -> str:
        from ftjob.ft.step.manager import Manager, ManagerConfig

        cfg = self.cfg
        start_step = self.resume()
        mgr = Manager(
            ManagerConfig(
                group=cfg.group,
                lighthouse_url=cfg.lighthouse_url,
                token=cfg.token,
                advertise_addr=cfg.advertise_addr,
                recovery_port=cfg.recovery_port,
                store_port=cfg.store_port,
                rank=cfg.rank,
                world_size=cfg.world_size,
                min_replicas=cfg.min_replicas,
                collective_timeout_s=cfg.collective_timeout_s,
                quorum_timeout_s=cfg.quorum_timeout_s,
                lost_timeout_s=cfg.lighthouse_lost_timeout_s,
                device=cfg.device,
                gradient_guard=cfg.gradient_guard,
                guard_norm_ratio=cfg.guard_norm_ratio,
                guard_sketch=cfg.guard_sketch,
                digest_every=cfg.digest_every,
            ),
            self.state_dict,
            self.load_state_dict,
            replica_state=lambda: replica_tensors(self.model, self.optimizer),  # what the state digests cover
        )
        mgr.register_params(self.params)  # gradient buckets all-reduced during the backward pass
        if start_step:
            mgr.step = start_step  # a whole-job restart: the checkpoint's step is where this group stands
        self._say(
            f"model {cfg.model} ({self.n_params / 1e6:.2f}M params), corpus {self.corpus.files} files "
            f"{self.corpus.data.numel() / 2**20:.1f} MiB, starting at step {mgr.step}"
        )
        if self.log:
            self.log.write(
                StartRecord(
                    group=cfg.group,
                    incarnation=self.incarnation,
                    step=mgr.step,
                    pid=os.getpid(),
                    corpus_digest=self.corpus.digest,
                    params=self.n_params,
                )
            )
        try:
            self._loop(mgr)
            if self.ckpt:
                self.ckpt.wait()
            params = full_params(self.model)
            digest = digest_of(params)
            if cfg.run_dir and cfg.rank == 0:
                torch.save(params, cfg.run_dir / f"final-params-group-{cfg.group}.pt")  # for exact comparisons
                cpu = cfg.run_dir / f"thread-cpu-group-{cfg.group}.json"  # hack/bench/bench_trainer.py prints it
                cpu.write_text(json.dumps(self.cpu.per_step()))
            if cfg.rank == 0:
                print(f"FTJOB_DONE group={cfg.group} step={mgr.step} digest={digest}", flush=True)
            if self.log:
                self.log.write(
                    FinishedRecord(group=cfg.group, incarnation=self.incarnation, step=mgr.step, param_digest=digest)
                )
            mgr.report_finished(digest)
            return digest
        finally:
            mgr.shutdown()

    def _loop(self, mgr: Any) -> None:
        cfg, b = self.cfg, self.cfg.batch_size
        window_t, window_tokens, last_loss = time.monotonic(), 0, float("nan")
        while mgr.step < cfg.steps:
            step_started = time.monotonic()
            q = mgr.start_quorum()
            t_quorum = time.monotonic()
            cursor = self.data.cursor  # read after start_quorum: a heal may have replaced it
            loss = None
            shard_start, rank_samples = -1, 0
            if q.contributing:
                shard_start, _ = shard_range(cursor, q.contributor_rank, q.num_contributors, b)
                r_start, r_end = rank_range(shard_start, b, cfg.rank, cfg.world_size)
                rank_samples = r_end - r_start
                self.optimizer.zero_grad(set_to_none=False)
                loss = forward_backward(self.model, self.source, r_start, r_end - r_start)
            else:
                ensure_zero_grads(self.params)
            t_compute = time.monotonic()
            mgr.allreduce_gradients(self.params)
            t_allreduce = time.monotonic()
            if mgr.should_commit():
                if mgr.step < cfg.steps:
                    mgr.prefetch_quorum()  # the next quorum's round-trip overlaps this optimizer step
                # where the step's time went, so the manager's overhead can be read off the records
                phases = {
                    "quorum": t_quorum - step_started,
                    "compute": t_compute - t_quorum,
                    "allreduce": t_allreduce - t_compute,
                    "commit": time.monotonic() - t_allreduce,
                }
                t_optimizer = time.monotonic()
                torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip)
                set_lr(self.optimizer, lr_at(q.step, cfg))  # q.step: the step this quorum trains
                self.optimizer.step()
                # The Manager times quorum/compute/allreduce/commit itself; only the loop knows these two.
                phases["optimizer"] = time.monotonic() - t_optimizer
                mgr.trainer_metrics.observe_phase("optimizer", phases["optimizer"])
                mgr.trainer_metrics.add_tokens(rank_samples * self.model.cfg.block_size)
                step_samples = q.num_contributors * b
                self.data.cursor = cursor + step_samples
                window_tokens += step_samples * self.model.cfg.block_size
                last_loss = loss if loss is not None else last_loss
                self._after_commit(mgr, q, cursor, step_samples, shard_start, loss, phases)
                self.cpu.step_done()
                if mgr.step % cfg.log_every == 0 or mgr.step == cfg.steps:
                    elapsed = time.monotonic() - window_t
                    self._say(
                        f"step {mgr.step}/{cfg.steps} loss {last_loss:.4f} groups {q.num_contributors}/"
                        f"{q.participants} tokens/s {window_tokens / max(elapsed, 1e-9):,.0f}"
                    )
                    window_t, window_tokens = time.monotonic(), 0
            if self.ckpt:  # (the next step zeroes the grads itself: contributing or not)
                self.ckpt.poll()
            pad = cfg.min_step_seconds - (time.monotonic() - step_started)
            if pad > 0:
                time.sleep(pad)  # simulated compute of a heavier model (--min-step-seconds), not synchronisation

    def _after_commit(
        self,
        mgr: Any,
        q: Any,
        cursor: int,
        step_samples: int,
        shard_start: int,
        loss: float | None,
        phases: dict[str, float],
    ) -> None:
        if self.log:
            self.log.write(
                CommitRecord(
                    group=self.cfg.group,
                    incarnation=self.incarnation,
                    step=mgr.step,
                    cursor=cursor,
                    step_samples=step_samples,
                    contributing=q.contributing,
                    shard=q.contributor_rank,
                    shard_start=shard_start,
                    shard_count=self.cfg.batch_size if q.contributing else 0,
                    num_contributors=q.num_contributors,
                    participants=q.participants,
                    healed=q.healed,
                    loss=loss,
                    tokens=(self.cfg.batch_size if q.contributing else 0) * self.model.cfg.block_size,
                    phases={k: round(v, 6) for k, v in phases.items()},
                )
            )
        if self.ckpt and self.cfg.checkpoint_every and mgr.step % self.cfg.checkpoint_every == 0:
            self.ckpt.save(mgr.step, self._checkpoint_state(mgr.step))


def main(cfg: TrainConfig) -> int:
    trainer = Trainer(cfg)
    try:
        trainer.run()
    except KeyboardInterrupt:
        return 130
    finally:
        if trainer.log:
            trainer.log.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0
