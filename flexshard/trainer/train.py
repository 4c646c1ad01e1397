"""The training job, run on every rank: mesh, data, model, sharding, optimizer, loop."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

import flexshard as fs

from .checkpointing import checkpoints as checkpointing
from .checkpointing.checkpoints import Job
from .checkpointing.preflight import load_errors
from .components.lr_schedule import build_lr_scheduler, current_lr
from .components.metrics import (
    MetricsWriter,
    ProgressBar,
    peak_flops_per_rank,
    peak_memory_mb,
    plot_losses,
    read_metrics,
    summary_table,
)
from .components.optimizers import build_optimizer
from .config import Config
from .config.tokenizer import load_tokenizer
from .data.dataset import DPSampler, ValidationBatches, load_tokens, split_tokens
from .models.layers import loss_fn
from .models.model import count_params, flops_per_token
from .models.moe import step_balance, tokens_per_expert
from .models.mtp import take_step_loss
from .parallel import bounded_waits
from .parallel.dims import ParallelDims, init_distributed, pick_device
from .parallel.exchange import configured_timeout, exchange_bytes
from .parallel.parallelize import Parallelized, checked_dims, local_batch, parallelize


def clip_gradients(job: Job) -> float:
    """The full model's gradient norm; gradients clipped to ``max_norm`` when > 0
    (with max_norm = inf the scale is exactly 1.0, so nothing changes). One call for
    every layout and both backends: the DTensor meshes cover dp, cp and tp; the other
    pipeline stages come over pp, EP's expert slices over the EP group."""
    parallel, meshes = job.parallel, job.meshes
    max_norm = job.cfg.training.max_norm or float("inf")
    experts = set(parallel.expert_fqns)
    expert_params = [
        param
        for module in parallel.modules
        for fqn, sub in module.named_modules()
        if fqn in experts
        for param in sub.parameters()
    ]
    norm = fs.clip_grad_norm_(
        list(parallel.parameters()),
        max_norm,
        pp_group=meshes.pp,
        extra_groups=[(expert_params, meshes.ep)] if meshes.ep is not None else (),
    )
    return float(norm)


def setup(cfg: Config, dims: ParallelDims | None = None) -> Job:
    """Everything the loop needs on this rank. ``dims``: the layout the launcher built
    and checked before starting the ranks; None: built here for the world joined."""
    device = pick_device(cfg.training.device)
    init_distributed(device, cfg.parallelism.timeout_s)  # the world's waits bounded too
    if dims is None:
        dims = checked_dims(cfg, dist.get_world_size())
    mesh = dims.build_mesh(device.type)
    meshes, dp_rank = dims.meshes(mesh), dims.dp_rank(mesh)
    t = cfg.training
    tokenizer = load_tokenizer(cfg.model)
    if cfg.data.source == "rl_task":  # the RL task's format, answers included
        from .rl.task import corpus

        tokens, validation = tokenizer.encode(corpus(cfg.rl, t.seed)), None
    else:
        tokens, validation = load_tokens(cfg.data, tokenizer), None
    if cfg.validation.enable:
        tokens, held_out = split_tokens(tokens, cfg.validation.fraction)
        validation = ValidationBatches(held_out, t.seq_len, t.batch_size, dp_rank, dims.dp_size)
    sampler = DPSampler(
        tokens,
        t.seq_len,
        t.batch_size,
        t.grad_accum,
        dp_rank,
        dims.dp_size,
        t.seed,
    )
    parallel = parallelize(cfg, dims, meshes, device)
    model = parallel.modules[0]
    # one module: the optimizer sees it (Muon groups by module); pipeline stages: all
    whole = model if len(parallel.modules) == 1 else parallel
    optimizer = build_optimizer(whole, t, cfg.model)  # type: ignore[arg-type]
    lr_scheduler = build_lr_scheduler(optimizer, t)
    folder = Path(cfg.job.dump_folder)
    return Job(
        cfg,
        device,
        dist.get_rank(),
        dims,
        dp_rank,
        model,
        optimizer,
        lr_scheduler,
        sampler,
        folder,
        meshes,
        parallel,
        tokenizer,
        validation,
    )


def train_step(job: Job, step: int) -> tuple[float, float, float]:
    """One optimizer step over ``grad_accum`` micro-batches; returns (loss of the global
    batch, full gradient norm, lr)."""
    cfg, model = job.cfg, job.model
    accum = cfg.training.grad_accum
    lr = current_lr(job.lr_scheduler)
    local_loss = torch.zeros((), device=job.device)
    runner, timeout = job.parallel.runner, configured_timeout(cfg.parallelism.timeout_s)
    # TP's DTensor collectives and the pipeline's sends wait at most the mesh groups'
    # timeout; a failure raises a CollectiveError naming the step
    with bounded_waits.step_in_flight(job.meshes, step + 1, timeout):
        for micro in range(accum):
            inputs, targets = job.sampler.batch(step, micro)
            inputs, targets = local_batch(inputs.to(job.device), targets.to(job.device), job.meshes)
            if runner is not None:  # the schedule syncs gradients on the last microbatch
                local_loss += runner.step(inputs, targets)
                continue
            # reduce gradients only after the last micro-batch (they accumulate unsharded)
            model.set_requires_gradient_sync(micro == accum - 1)  # type: ignore[operator]
            loss = loss_fn(model(inputs), targets) / accum
            loss.backward()
            local_loss += loss.detach()
    grad_norm = clip_gradients(job)
    job.optimizer.step()
    dp_groups = job.meshes.dp.get_all_groups()
    step_balance(
        job.parallel.modules,
        bounded_waits.all_reduce_over(dp_groups, "MoE load all-reduce", timeout),
    )
    job.lr_scheduler.step()
    job.optimizer.zero_grad(set_to_none=True)
    # the global batch's loss: mean over all ranks; tp and pp ranks hold the same value
    # and dp x cp ranks equal token counts, so that is the mean over the global batch
    of = f"training step {step + 1}"
    bounded_waits.all_reduce(local_loss, None, "loss all-reduce", of, timeout, dist.ReduceOp.AVG)
    return float(local_loss), grad_norm, lr


@torch.no_grad()
def validate(job: Job) -> float:
    """Mean loss over ``validation.steps`` held-out batches, averaged over the ranks
    (equal token counts per rank, as in training)."""
    assert job.validation is not None
    total = torch.zeros((), device=job.device)
    steps = job.cfg.validation.steps
    timeout = configured_timeout(job.cfg.parallelism.timeout_s)
    with bounded_waits.in_flight("validation forward", "validation", {"tp": _group(job.meshes.tp)}):
        for index in range(steps):
            inputs, targets = job.validation.batch(index)
            inputs, targets = local_batch(inputs.to(job.device), targets.to(job.device), job.meshes)
            total += loss_fn(job.model(inputs), targets) / steps
    avg = dist.ReduceOp.AVG
    bounded_waits.all_reduce(total, None, "validation loss all-reduce", "validation", timeout, avg)
    return float(total)


def _group(mesh: DeviceMesh | None) -> dist.ProcessGroup | None:
    return mesh.get_group() if mesh is not None else None


def _comm_bytes(parallel: Parallelized) -> dict[str, int] | None:
    """Bytes this rank sent since the last call, over every stage module. flexshard:
    its ``comm_stats()`` per bucket, ``ep`` / ``cp`` (the expert- and context-parallel
    exchanges) and their ``total``. FSDP2: ``ep`` / ``cp`` alone (no ``total``)."""
    flex = [m for m in parallel.modules if isinstance(m, fs.FlexShardModule)]
    if len(flex) < len(parallel.modules):
        return exchange_bytes(parallel.modules) or None
    sent: dict[str, int] = {}
    for module in flex:
        stats = module.comm_stats(reset=True)
        total = sent.pop("total", 0) + stats.pop("total")["bytes_sent"]
        for name, entry in stats.items():  # stages may share a bucket name ("outer")
            sent[name] = sent.get(name, 0) + entry["bytes_sent"]
        sent["total"] = total
    return sent


def run(cfg: Config, dims: ParallelDims | None = None) -> list[dict[str, Any]]:
    """Train; return this rank's per-step records (rank 0 also writes them out)."""
    job = setup(cfg, dims)
    t, leader = cfg.training, job.rank == 0
    with load_errors(cfg):  # one line naming the checkpoint, not a traceback per rank
        start_step = checkpointing.maybe_resume(job)
        if start_step == 0 and cfg.checkpoint.initial_load_path:
            checkpointing.initial_load(job)
    writer = MetricsWriter(job.folder, cfg.job.tensorboard, start_step > 0) if leader else None
    progress = ProgressBar(t.steps, start_step) if leader and cfg.job.progress else None
    tokens_per_step = job.sampler.global_batch * t.seq_len
    flops_token = flops_per_token(cfg.model, t.seq_len)
    peak = peak_flops_per_rank(job.device, cfg.job.peak_tflops)
    records = []
    _comm_bytes(job.parallel)  # count from the first step on
    rl = None
    if cfg.rl.enable:  # GRPO: the step generates, scores and updates (trainer/rl)
        from .rl.grpo import GRPO

        rl = GRPO(job, clip_gradients)
    for step in range(start_step, t.steps):
        if rl is not None:
            record = rl.step(step)
            per_rank = record["tokens_per_s"] / job.dims.world_size
            record["mfu"] = flops_token * per_rank / peak if peak else 0.0
        else:
            record = _train_record(job, step, tokens_per_step, flops_token, peak)
        loss = record["loss"]
        records.append(record)
        logged = (step + 1) % cfg.job.log_every == 0 or step + 1 == t.steps
        if writer is not None and (logged or "val_loss" in record):
            writer.log(record)
        if progress is not None:
            progress.update(step + 1, loss, record["tokens_per_s"])
        if cfg.checkpoint.enable and (
            (step + 1) % cfg.checkpoint.interval == 0 or step + 1 == t.steps
        ):
            checkpointing.save(job, step + 1)
    checkpointing.wait_for_saves(job)  # the last background save complete
    if progress is not None:
        progress.close()
    if cfg.checkpoint.export_safetensors:
        checkpointing.export(job, hf=False)
    if cfg.checkpoint.last_save_in_hf:
        path = checkpointing.export(job)
        if leader:
            print(f"Hugging Face model: {path}", flush=True)
    if writer is not None:
        writer.close()
        _report(job, writer.note)
    # end together: no rank tears its process group down while another still reports
    with bounded_waits.in_flight("end-of-run barrier", "the job", {"world": dist.group.WORLD}):
        dist.barrier()
    return records


def _train_record(
    job: Job, step: int, tokens_per_step: int, flops_token: float, peak: float
) -> dict[str, Any]:
    """One pre-training step and its metrics row."""
    cfg, t = job.cfg, job.cfg.training
    begin = time.perf_counter()
    loss, grad_norm, lr = train_step(job, step)
    if job.device.type == "cuda":
        torch.cuda.synchronize(job.device)
    seconds = time.perf_counter() - begin
    per_rank = tokens_per_step / job.dims.world_size / seconds
    record = {
        "step": step + 1,
        "loss": loss,
        "tokens_per_s": tokens_per_step / seconds,
        "tokens_per_s_per_rank": per_rank,
        "grad_norm": grad_norm,
        "lr": lr,
        "mfu": flops_token * per_rank / peak if peak else 0.0,
        "step_time_s": seconds,
        "peak_memory_mb": peak_memory_mb(job.device),
        "comm_bytes": _comm_bytes(job.parallel),
    }
    # a dense model has no counts to gather: no pp collective for it every step
    moe = cfg.model.moe.num_experts > 0
    pp = job.meshes.pp.get_group() if job.meshes.pp is not None and moe else None
    loads = tokens_per_expert(job.parallel.modules, pp)  # every stage's layers
    if loads:  # MoE: the global batch's routed rows per expert, by layer
        record["tokens_per_expert"] = loads
    mtp_loss = take_step_loss(job.parallel.modules)
    if mtp_loss is not None:  # the global batch's multi-token prediction loss
        of, avg = f"training step {step + 1}", dist.ReduceOp.AVG
        timeout = configured_timeout(cfg.parallelism.timeout_s)
        bounded_waits.all_reduce(mtp_loss, None, "MTP loss all-reduce", of, timeout, avg)
        record["mtp_loss"] = float(mtp_loss)
    v = cfg.validation
    if v.enable and ((step + 1) % v.freq == 0 or step + 1 == t.steps):
        record["val_loss"] = validate(job)
        record["val_perplexity"] = math.exp(min(record["val_loss"], 80.0))
    return record


def _report(job: Job, note: str) -> None:
    """Rank 0, at the end: the summary table and the loss-curve PNG."""
    cfg = job.cfg
    records = read_metrics(job.folder / "metrics.jsonl")
    total, active = count_params(cfg.model)
    header = {
        "run": cfg.job.description or str(job.folder),
        "backend": f"{cfg.parallelism.dp_backend} ({cfg.parallelism.placement})",
        "mesh": " x ".join(
            f"{name}={job.dims.degree(name)}"
            for name in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")
            if job.dims.degree(name) > 1 or name == "dp_shard"
        ),
        "parameters": f"{total:,} ({active:,} active, no embedding)",
        "global batch": f"{job.sampler.global_batch} x {cfg.training.seq_len} tokens",
    }
    print(summary_table(records, header), flush=True)
    if cfg.job.plot and records:
        print(plot_losses(records, job.folder / "loss.png", header["run"]), flush=True)
    for line in (note, f"metrics: {job.folder / 'metrics.jsonl'}"):
        if line:
            print(line, flush=True)
