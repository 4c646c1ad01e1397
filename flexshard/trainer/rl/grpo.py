"""On-policy GRPO in the trainer: each step the (sharded) model samples ``group_size``
completions per prompt with its own forward and KV cache, the task's verifier scores
them, rewards are normalised within each prompt's group, and the same model is
updated through the trainer's optimizer, lr schedule and clipping with the clipped
ratio loss averaged over every completion token of the global batch (DAPO), plus a k3
KL to a frozen copy of the starting weights when ``rl.kl_coef > 0``.

Nothing is kept between steps: step ``s``'s prompts and sampling seeds are functions of
(training.seed, s), so a checkpoint's step restores them."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..checkpointing import checkpoints as checkpointing
from ..checkpointing.checkpoints import Job
from ..components.lr_schedule import current_lr
from ..components.metrics import peak_memory_mb
from ..config import Config, ConfigError
from ..models.linear_attention import token_by_token
from ..models.moe import step_balance, tokens_per_expert
from ..parallel.bounded_waits import all_reduce_over
from ..parallel.dims import ParallelDims
from ..parallel.exchange import configured_timeout
from ..parallel.parallelize import parallelize
from . import task
from .batch_invariant import batch_invariant
from .rollout import Completion, rollout, token_logprobs


def check_rl(cfg: Config, dims: ParallelDims) -> None:
    """What GRPO (and pre-training on the task) runs with, refused before any rank
    starts otherwise (``dims``: the layout the launcher built)."""
    r, p = cfg.rl, cfg.parallelism
    if not (r.enable or cfg.data.source == "rl_task"):
        return
    task.check_task(r, cfg.training.seq_len)
    if cfg.model.tokenizer != "bytes":
        raise ConfigError(
            f"model.tokenizer = {cfg.model.tokenizer!r}: the rl task is written in bytes; "
            'use model.tokenizer = "bytes"'
        )
    if not r.enable:
        return
    for key, value in (
        ("rl.prompts_per_step", r.prompts_per_step),
        ("rl.group_size", r.group_size),
        ("rl.max_new_tokens", r.max_new_tokens),
    ):
        if value < 1:
            raise ConfigError(f"{key} = {value}: must be at least 1")
    if r.prompts_per_step % dims.dp_size:
        raise ConfigError(
            f"rl.prompts_per_step = {r.prompts_per_step} is not divisible by the "
            f"{dims.dp_size} data-parallel ranks (dp_replicate x dp_shard): set it to a "
            "multiple of them"
        )
    if r.group_size < 2:
        raise ConfigError(
            f"rl.group_size = {r.group_size}: GRPO normalises rewards within a group, "
            "which needs at least 2 completions per prompt"
        )
    if r.micro_batch < 0 or r.kl_coef < 0 or not 0 <= r.clip_low < 1 or r.clip_high < 0:
        raise ConfigError(
            "rl.micro_batch and rl.kl_coef must be >= 0, rl.clip_low in [0, 1), rl.clip_high >= 0"
        )
    if not r.temperature > 0:
        raise ConfigError(f"rl.temperature = {r.temperature}: must be > 0")
    for key, value in (
        ("parallelism.pp", p.pp),
        ("parallelism.cp", p.cp),
        ("parallelism.ep", p.ep),
    ):
        if value > 1:
            raise ConfigError(
                f"{key} = {value}: rl (GRPO) generates with the model's KV cache, which "
                "is not wired with pipeline, context or expert parallelism; set it to 1"
            )
    if p.tp > 1 and p.sequence_parallel:
        raise ConfigError(
            f"parallelism.tp = {p.tp} with sequence_parallel = true: rl decodes one token "
            "per step, which cannot be split over tp; set parallelism.sequence_parallel = false"
        )
    if p.dp_backend != "flexshard":
        raise ConfigError('rl runs on parallelism.dp_backend = "flexshard"')
    if cfg.compile.enable or cfg.validation.enable or cfg.training.grad_accum != 1:
        raise ConfigError(
            "rl: compile.enable and validation.enable must be false and "
            "training.grad_accum 1 (rl.micro_batch splits the completions instead)"
        )
    if cfg.training.mixed_precision != "fp32" and r.batch_invariant:
        raise ConfigError('rl.batch_invariant needs training.mixed_precision = "fp32"')
    if cfg.model.mtp_layers:
        raise ConfigError(
            f"model.mtp_layers = {cfg.model.mtp_layers}: rl's update would add the "
            "multi-token prediction loss on the sampled (padded) completions to the policy "
            "gradient; set model.mtp_layers = 0"
        )


def reference_model(job: Job) -> nn.Module:
    """A frozen copy of the starting weights, sharded as the policy is: the seeded
    initialisation, then ``checkpoint.initial_load_path`` when there is one."""
    ref = parallelize(job.cfg, job.dims, job.meshes, job.device)
    if job.cfg.checkpoint.initial_load_path:
        checkpointing.initial_load(dataclasses.replace(job, model=ref.modules[0], parallel=ref))
    for param in ref.parameters():
        param.requires_grad_(False)
    return ref.modules[0]


def advantages(rewards: torch.Tensor) -> torch.Tensor:
    """[prompts, group] rewards normalised within each group (0 where all are equal)."""
    mean, std = rewards.mean(1, keepdim=True), rewards.std(1, keepdim=True)
    return (rewards - mean) / (std + 1e-6)


def _sum(values: list[float], op: dist.ReduceOp = dist.ReduceOp.SUM) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor, op=op)
    return tensor.tolist()


def score(
    prompts: list[task.Prompt], groups: list[list[Completion]], decode: Callable[..., str]
) -> tuple[torch.Tensor, dict[str, int], list[str]]:
    """Rewards [prompts, group], the counts of odd outcomes, and what the verifier
    raised: an empty answer scores as any other, a completion cut at the token budget
    scores 0, a verifier that raises scores 0 (the run goes on)."""
    counts = {"verifier_errors": 0, "empty_completions": 0, "truncated": 0, "solved": 0}
    rewards = torch.zeros(len(groups), max((len(g) for g in groups), default=0))
    raised = []
    for i, (prompt, group) in enumerate(zip(prompts, groups)):
        for j, done in enumerate(group):
            text = decode(done.tokens[:-1] if done.finished else done.tokens)
            counts["truncated"] += not done.finished
            counts["empty_completions"] += done.finished and not text
            try:
                rewards[i, j] = task.reward(prompt, text) if done.finished else 0.0
            except Exception as err:  # a broken verifier costs the sample, not the run
                counts["verifier_errors"] += 1
                raised.append(f"rl: the verifier raised on {prompt.text!r}: {err!r}")
            counts["solved"] += bool(rewards[i, j] == 1.0)
    return rewards, counts, raised


class GRPO:
    def __init__(self, job: Job, clip: Callable[[Job], float]) -> None:
        """``clip``: the trainer's gradient clipping, returning the full norm (passed in:
        the trainer imports this file)."""
        r = job.cfg.rl  # checked before the ranks started: check_rl
        self.job, self.r, self.clip = job, r, clip
        self.eos = int(job.tokenizer.encode(task.EOS)[-1])  # type: ignore[union-attr]
        self.per_rank = r.prompts_per_step // job.dims.dp_size
        self.copies = job.dims.world_size // job.dims.dp_size  # ranks holding one dp rank's data
        self.reference = reference_model(job) if r.kl_coef > 0 else None
        self.errors_logged = False

    def _mode(self) -> contextlib.AbstractContextManager:
        """Batch-invariant mode: the swapped kernels, and the Gated DeltaNet layers'
        recurrence in every forward (the generator's and the trainer's alike)."""
        mode = contextlib.ExitStack()
        if self.r.batch_invariant:
            mode.enter_context(batch_invariant())
            mode.enter_context(token_by_token())
        return mode

    def _loss(self, rows: list[Completion], adv: list[float], tokens: float) -> dict[str, Any]:
        """Forward and backward of one micro-batch; its per-token statistics."""
        job, r = self.job, self.r
        seqs = [torch.cat([c.prompt, c.tokens]) for c in rows]
        width = max(len(s) for s in seqs) - 1
        inputs = torch.zeros(len(seqs), width, dtype=torch.long)
        targets, mask = torch.zeros_like(inputs), torch.zeros(len(seqs), width, dtype=torch.bool)
        old, gain = torch.zeros(len(seqs), width), torch.zeros(len(seqs), width)
        for i, (seq, done) in enumerate(zip(seqs, rows)):
            inputs[i, : len(seq) - 1], targets[i, : len(seq) - 1] = seq[:-1], seq[1:]
            first = len(done.prompt) - 1  # the target of position first is completion token 0
            span = slice(first, first + len(done.tokens))
            mask[i, span], old[i, span], gain[i, span] = True, done.logprobs, adv[i]
        inputs, targets = inputs.to(job.device), targets.to(job.device)
        new = token_logprobs(job.model(inputs), targets, r.temperature).cpu()
        ratio = torch.exp(new - old)
        clipped = ratio.clamp(1 - r.clip_low, 1 + r.clip_high)
        terms = -torch.minimum(ratio * gain, clipped * gain)
        stats: dict[str, Any] = {}
        if self.reference is not None:
            with torch.no_grad():
                ref = token_logprobs(self.reference(inputs), targets, r.temperature).cpu()
            k3 = torch.expm1(ref - new) - (ref - new)  # exp(d) - d - 1, small d kept
            terms = terms + r.kl_coef * k3
            stats["kl"] = float(k3[mask].detach().sum())
        scale = job.dims.dp_size / tokens  # gradients are averaged over the dp ranks
        loss = terms[mask].sum() * scale
        loss.backward()
        dev = (ratio[mask] - 1).detach()
        stats.update(
            loss=float(terms[mask].sum().detach()) / tokens,
            diff=float((new.detach() - old)[mask].abs().max()),
            ratio_sum=float(ratio[mask].detach().sum()),
            ratio_min=float(ratio[mask].detach().min()),
            ratio_max=float(ratio[mask].detach().max()),
            ratio_dev=float(dev.abs().max()),
            clipped=float((clipped != ratio)[mask].sum()),
            forwarded=inputs.numel(),
        )
        return stats

    def step(self, step: int) -> dict[str, Any]:
        """One RL step: rollout, rewards, update; its metrics row (every rank)."""
        job, r, cfg = self.job, self.r, self.job.cfg
        begin = time.perf_counter()
        timeout = configured_timeout(cfg.parallelism.timeout_s)
        everything = task.prompts(r, cfg.training.seed, step)
        mine = everything[job.dp_rank * self.per_rank : (job.dp_rank + 1) * self.per_rank]
        encode = job.tokenizer.encode  # type: ignore[union-attr]
        seed = (cfg.training.seed * 1_000_003 + step) * 4099 + job.dp_rank
        sampler = torch.Generator().manual_seed(seed)
        lengths = [task.prompt_len(len(p.answer)) for p in everything]
        with self._mode():
            groups = rollout(
                job.model,
                [encode(p.text) for p in mine],
                lengths,
                r.group_size,
                r.max_new_tokens,
                cfg.training.seq_len,
                self.eos,
                r.temperature,
                sampler,
            )
            generated = sum(len(c.tokens) for g in groups for c in g)
            gen_seconds = time.perf_counter() - begin
            rewards, counts, raised = score(mine, groups, job.tokenizer.decode)  # type: ignore[union-attr]
            if raised and not self.errors_logged:  # once per run, then counted
                print(raised[0], flush=True)
                self.errors_logged = True
            adv = advantages(rewards)
            rows = [c for g in groups for c in g]
            row_adv = adv.reshape(-1).tolist()
            lengths_done = [len(c.tokens) for c in rows]
            tokens = _sum([sum(lengths_done)])[0] / self.copies
            micro = r.micro_batch or len(rows)
            train_begin = time.perf_counter()
            parts = []
            for start in range(0, len(rows), micro):
                last = start + micro >= len(rows)
                job.model.set_requires_gradient_sync(last)  # type: ignore[operator]
                parts.append(
                    self._loss(rows[start : start + micro], row_adv[start : start + micro], tokens)
                )
            lr = current_lr(job.lr_scheduler)
            grad_norm = self.clip(job)
            job.optimizer.step()
            dp_groups = job.meshes.dp.get_all_groups()
            step_balance(
                job.parallel.modules,
                all_reduce_over(dp_groups, "MoE load all-reduce", timeout),
            )
            job.lr_scheduler.step()
            job.optimizer.zero_grad(set_to_none=True)
        train_seconds = time.perf_counter() - train_begin
        local = [
            float(rewards.sum()),
            float(rewards.numel()),
            sum(p["loss"] for p in parts),
            sum(p["ratio_sum"] for p in parts),
            sum(p["clipped"] for p in parts),
            float(generated),
            float(sum(p["forwarded"] for p in parts)),
            float(sum(lengths_done)),
            sum(p.get("kl", 0.0) for p in parts),
            *map(float, counts.values()),
        ]
        total = [v / self.copies for v in _sum(local)]
        reward_sum, n, loss, ratio_sum, clipped, gen_tokens, trained, done_tokens, kl = total[:9]
        extremes = _sum(
            [
                max(p["diff"] for p in parts),
                max(p["ratio_max"] for p in parts),
                -min(p["ratio_min"] for p in parts),
                max(p["ratio_dev"] for p in parts),
                float(max(lengths_done)),
            ],
            dist.ReduceOp.MAX,
        )
        seconds = time.perf_counter() - begin
        record: dict[str, Any] = {
            "step": step + 1,
            "reward": reward_sum / n,
            "loss": loss,
            "logprob_max_abs_diff": extremes[0],
            "ratio_mean": ratio_sum / done_tokens,
            "ratio_min": -extremes[2],
            "ratio_max": extremes[1],
            "ratio_max_abs_dev": extremes[3],
            "clip_fraction": clipped / done_tokens,
            "kl": kl / done_tokens if self.reference is not None else None,
            "completion_len_mean": done_tokens / n,
            "completion_len_max": int(extremes[4]),
            **{key: int(v) for key, v in zip(counts, total[9:])},
            "gen_tokens_per_s": gen_tokens / gen_seconds,
            "train_tokens_per_s": trained / train_seconds,
            "tokens_per_s": trained / train_seconds,
            "grad_norm": grad_norm,
            "lr": lr,
            "step_time_s": seconds,
            "peak_memory_mb": peak_memory_mb(job.device),
        }
        record["solved"] = record["solved"] / n
        loads = tokens_per_expert(job.parallel.modules)  # pp is refused: every layer here
        if loads:  # MoE: the update's routed rows per expert, by layer
            record["tokens_per_expert"] = loads
        return record
