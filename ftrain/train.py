"""The training loop: one optimizer step per global batch, whatever the world size.

Each step takes the next global batch from the world-size-independent cursor, runs this
data-parallel rank's contiguous block of micro-batches (accumulating gradients without
communication until the last), reduces gradients, clips, sets the scheduled LR, steps the
optimizer, and reports: metrics JSON line, progress and peak memory per rank.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ftrain.config import Config
from ftrain.data import DataCursor, Ledger, accumulation_steps, build_source, micro_batches
from ftrain.distributed import compute_layout, init_distributed, select_device, select_dtype, shutdown_distributed
from ftrain.metrics import MetricsWriter, peak_memory_bytes
from ftrain.model import build_model, count_parameters
from ftrain.optim import lr_at, peak_lr, set_lr
from ftrain.parallel import Parallel, parallelize
from ftrain.progress import Progress

log = logging.getLogger(__name__)


@dataclass(slots=True)
class TrainResult:
    steps: int
    final_loss: float
    entropy_floor_nats: float | None
    wall_time_s: float
    world_size: int


def _step_stats(losses: list[torch.Tensor], peak_bytes: int, par: Parallel) -> tuple[float, list[int]]:
    """All ranks' micro-batch losses and peak memory in one all-gather.

    The loss is summed in float64 in global micro-batch order (ranks of one tensor-parallel
    group hold the same losses; the first of each counts), so it does not depend on how the
    micro-batches were spread over ranks.
    """
    layout = par.layout
    local = torch.tensor([float(x) for x in losses] + [float(peak_bytes)], dtype=torch.float64, device=par.device)
    gathered = torch.empty(layout.world_size * local.numel(), dtype=torch.float64, device=par.device)
    dist.all_gather_single(gathered, local)
    rows = gathered.view(layout.world_size, -1).cpu()
    total, count = 0.0, 0
    for rank in range(0, layout.world_size, layout.tp_size):
        for value in rows[rank, :-1].tolist():
            total += value
            count += 1
    return total / count, [int(v) for v in rows[:, -1].tolist()]


def train(cfg: Config) -> TrainResult:
    device = select_device(cfg.train)
    dtype = select_dtype(cfg.train, device)
    rank, world_size, local_world = init_distributed(cfg.parallel, device)
    try:
        return _train(cfg, device, dtype, rank, world_size, local_world)
    finally:
        shutdown_distributed()


def _train(cfg: Config, device: torch.device, dtype: torch.dtype, rank: int, world_size: int,
           local_world: int) -> TrainResult:
    n_head = cfg.model.n_head if not cfg.model.factory else None
    layout = compute_layout(cfg.parallel, world_size=world_size, rank=rank,
                            local_world_size=local_world, n_head=n_head)
    accum = accumulation_steps(cfg.train.global_batch_size, cfg.train.micro_batch_size, layout.dp_size)
    source = build_source(cfg.data, cfg.model)
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model)
    num_params = count_parameters(model)
    par = parallelize(model, cfg, layout, device, dtype, accum)
    cursor = DataCursor(source.num_samples, cfg.train.global_batch_size, cfg.data.seed)
    ledger = Ledger(cfg.data.ledger_dir, layout.dp_rank, round_=0) \
        if cfg.data.ledger_dir and layout.tp_rank == 0 else None
    metrics = MetricsWriter(cfg.logging.metrics_path) if cfg.logging.metrics_path and rank == 0 else None
    progress = Progress(cfg.train.steps, cfg.logging.progress if rank == 0 else "off", cfg.logging.log_every)
    peak = peak_lr(cfg.optim, layout.dp_size)
    floor = getattr(source, "entropy_floor_nats", None)
    progress.message(
        f"ftrain: {num_params / 1e6:.2f}M params, {layout.strategy} on {world_size} rank(s) "
        f"(dp={layout.dp_size} tp={layout.tp_size}), accumulation {accum} x micro-batch "
        f"{cfg.train.micro_batch_size} = global batch {cfg.train.global_batch_size}, {device.type} "
        f"{str(dtype).removeprefix('torch.')}"
        + (f", entropy floor {floor:.4f} nats" if floor is not None else "")
    )
    seq_len = cfg.model.seq_len
    start = time.perf_counter()
    loss = float("nan")
    try:
        for step in range(cursor.step, cfg.train.steps):
            t0 = time.perf_counter()
            batch = cursor.next_global_batch()
            micros = micro_batches(batch, layout.dp_rank, layout.dp_size, cfg.train.micro_batch_size)
            losses = []
            for i, micro in enumerate(micros):
                tokens = torch.from_numpy(source.sample(micro.sample_ids)).to(device, non_blocking=True)
                with par.grad_sync(is_last=i == accum - 1):
                    with par.autocast():
                        logits = par.model(tokens[:, :-1])
                    micro_loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
                    par.backward(micro_loss, i, accum)
                losses.append(micro_loss.detach())
            par.reduce_gradients()
            grad_norm = par.clip_grad_norm(cfg.train.grad_clip)
            lr = lr_at(step, peak=peak, warmup_steps=cfg.optim.warmup_steps,
                       total_steps=cfg.train.steps, min_lr_ratio=cfg.optim.min_lr_ratio)
            set_lr(par.optimizer.param_groups, lr)
            par.optimizer.step()
            par.optimizer.zero_grad(set_to_none=True)
            if ledger is not None:
                ledger.record(batch, micros)
            loss, peaks = _step_stats(losses, peak_memory_bytes(device), par)
            step_time_s = time.perf_counter() - t0
            record: dict[str, Any] = {
                "step": step + 1,
                "loss": loss,
                "grad_norm": grad_norm,
                "lr": lr,
                "tokens_per_s": cfg.train.global_batch_size * seq_len / step_time_s,
                "step_time_s": step_time_s,
                "world_size": world_size,
                "dp_size": layout.dp_size,
                "accum_steps": accum,
                "epoch": batch.epoch,
                "peak_mem_bytes": peaks,
                "time": time.time(),
            }
            if metrics is not None:
                metrics.write(record)
            progress.update(step + 1, record)
        wall = time.perf_counter() - start
        if cfg.train.save_final_path:
            _save_final(par, cfg, cursor.state_dict())
        if floor is not None:
            progress.message(f"done: loss {loss:.4f} vs entropy floor {floor:.4f} "
                             f"(+{loss - floor:.4f} nats) in {wall:.1f}s")
        else:
            progress.message(f"done: loss {loss:.4f} in {wall:.1f}s")
        return TrainResult(cfg.train.steps, loss, floor, wall, world_size)
    finally:
        if metrics is not None:
            metrics.close()
        if ledger is not None:
            ledger.close()


def _save_final(par: Parallel, cfg: Config, cursor_state: dict[str, Any]) -> None:
    model_sd, optim_sd = par.full_state_dict()
    if dist.get_rank() == 0:
        torch.save({"model": model_sd, "optim": optim_sd, "cursor": cursor_state,
                    "config": cfg.to_dict(), "layout": par.layout.describe()}, cfg.train.save_final_path)
