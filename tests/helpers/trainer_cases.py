"""Shared pieces of the trainer tests: a tiny config and the single-process reference."""

from __future__ import annotations

import torch

from flexshard.trainer.components.lr_schedule import lr_factor
from flexshard.trainer.components.optimizers import build_optimizer
from flexshard.trainer.config import Config, TrainingConfig, config_from_dict
from flexshard.trainer.data.dataset import ByteTokenizer, DPSampler, load_tokens
from flexshard.trainer.models.model import Transformer, init_weights, meta_model
from flexshard.trainer.parallel.dims import ParallelDims
from flexshard.trainer.parallel.parallelize import checked_dims, full_model_state
from flexshard.trainer.train import Job, loss_fn

STEPS = 20


def launch_dims(cfg: Config) -> ParallelDims:
    """The layout ``flexshard-train`` builds for ``cfg`` before spawning, on the world
    its degrees make (``dp_shard = -1``: one)."""
    p = cfg.parallelism
    world = p.dp_replicate * max(p.dp_shard, 1) * p.cp * p.tp * p.pp
    return checked_dims(cfg, world)


def set_lr(optimizer: torch.optim.Optimizer, step: int, t: TrainingConfig) -> None:
    """The references' schedule, by hand: every group at its initial lr times the
    closed-form factor of ``step`` (the trainer steps a LambdaLR instead)."""
    for group in optimizer.param_groups:
        group.setdefault("base_lr", group["lr"])
        group["lr"] = group["base_lr"] * lr_factor(step, t)


def whole_parameters(job: Job) -> dict[str, torch.Tensor]:
    """The whole model's parameters (its buffers left out), gathered on every rank by
    the trainer's one path (every rank calls it)."""
    names = {name for name, _ in meta_model(job.cfg.model).named_parameters()}
    state = full_model_state(job.parallel, job.meshes)
    return {name: value for name, value in state.items() if name in names}


def tiny_config(folder: str, **sections: dict) -> Config:
    """Seconds per run: dim 40 (head dim 10), ffn 34 and kv rows 20, which W = 3 and 4
    do not divide."""
    table: dict = {
        "model": {"dim": 40, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 34},
        "training": {
            "steps": STEPS,
            "seq_len": 32,
            "batch_size": 2,
            "lr": 3e-3,
            "muon_lr": 3e-3,
            "seed": 3,
        },
        "job": {"dump_folder": folder, "progress": False, "plot": False, "tensorboard": False},
    }
    for name, values in sections.items():
        table[name] = {**table.get(name, {}), **values}
    return config_from_dict(table)


def single_process_losses(cfg: Config, dp_size: int) -> list[float]:
    """What ``dp_size`` data-parallel ranks must compute together, in one process: each
    step trains on the union of the ranks' batches (``dp_size * grad_accum * batch``
    sequences) in one batch, so the mean loss and its gradient are those of DP."""
    return single_process_run(cfg, dp_size)[0]


def single_process_run(cfg: Config, dp_size: int) -> tuple[list[float], dict]:
    """``single_process_losses`` and the trained parameters (a state dict)."""
    t = cfg.training
    model = Transformer(cfg.model)
    init_weights(model, t.seed)
    tokens = load_tokens(cfg.data, ByteTokenizer())
    sampler = DPSampler(tokens, t.seq_len, dp_size * t.grad_accum * t.batch_size, 1, 0, 1, t.seed)
    optimizer = build_optimizer(model, t, cfg.model)
    losses = []
    for step in range(t.steps):
        set_lr(optimizer, step, t)
        inputs, targets = sampler.batch(step)
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.max_norm or float("inf"))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach() for k, v in model.state_dict().items()}
