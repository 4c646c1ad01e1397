"""The 5-D composition, torchtitan style: one small ``apply_*`` per concern, applied in
one place. The order matters: TP rewrites the modules' parameters into DTensors, EP
slices the experts, PP then cuts the model into stages (TP and EP travel with the
blocks), CP switches each stage's attention to its sequence shard,
``[activation_checkpoint]`` marks blocks to recompute, ``[compile]`` compiles each
block, and data parallelism (flexshard or torch FSDP2) shards what is left: expert
weights on their own ``dp_shard_mod_ep`` mesh, everything else per block
over dp_replicate x (dp_shard * cp).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import flexshard as fs
from flexshard.fsdp.state_dict import Assemble

from ..config import Config, ConfigError
from ..models.layers import loss_fn
from ..models.model import build_model, init_module, init_weights
from .activation_checkpoint import apply_ac
from .context_parallel import apply_cp, check_cp, split_sequence
from .dims import Meshes, ParallelDims
from .exchange import configured_timeout
from .expert_parallel import apply_ep, check_ep, check_ep_ranks, whole_experts
from .pipeline import PipelineRunner, build_pipeline, check_pipeline, init_stage_params
from .sharding import apply_dp, check_backend_options, mp_policy
from .tensor_parallel import apply_tp, check_tp


@dataclass
class Parallelized:
    """This rank's share of the model: one module, or the pipeline's stage modules."""

    modules: list[nn.Module]
    runner: PipelineRunner | None = None
    expert_fqns: list[str] = field(default_factory=list)

    def parameters(self) -> Iterator[nn.Parameter]:
        for module in self.modules:
            yield from module.parameters()


def apply_compile(module: nn.Module, cfg: Config) -> None:
    """torch.compile each transformer block, as torchtitan does, before data parallelism
    shards it: flexshard's (and FSDP2's) hooks run eagerly around the compiled block, so
    each block is one graph of its own computation (``fullgraph``: a break raises)."""
    for layer in module.layers.children():  # type: ignore[union-attr]
        layer.compile(backend=cfg.compile.backend, fullgraph=True)


def parallelize(
    cfg: Config, dims: ParallelDims, meshes: Meshes, device: torch.device, init: bool = True
) -> Parallelized:
    """TP -> EP -> PP split -> CP -> AC -> compile -> DP, every rank ending with the
    single process's seeded weights. flexshard: built on meta and initialised after
    sharding, module by module (no rank ever holds the whole model); FSDP2: built whole
    on ``device`` first. ``init=False``: the weights are left uninitialised, for a
    caller that loads them (generation) or only reads the layout (the planner, on
    meta, where initialising would write nothing)."""
    par = cfg.parallelism
    on_meta = par.dp_backend == "flexshard"
    with torch.device("meta" if on_meta else device):
        model = build_model(cfg.model)
    if init and not on_meta:
        init_weights(model, cfg.training.seed)
    if model.mtp is not None:  # the MTP term follows the loss's division by grad_accum
        model.mtp.loss_scale = 1 / cfg.training.grad_accum
    sequence_parallel = meshes.tp is not None and par.sequence_parallel
    if meshes.tp is not None:
        # under PP too: stages then exchange the [b, s / tp, d] sequence shards
        apply_tp(model, meshes.tp, sequence_parallel=sequence_parallel)
    timeout = configured_timeout(par.timeout_s)
    expert_fqns = apply_ep(model, meshes.ep, timeout) if meshes.ep is not None else []

    def finish(module: nn.Module) -> nn.Module:
        if meshes.cp is not None:
            apply_cp(module, meshes.cp, par.cp_method, timeout)
        apply_ac(module, cfg.activation_checkpoint)  # inside compile's graph and DP's hooks
        if cfg.compile.enable:
            apply_compile(module, cfg)
        return apply_dp(module, cfg, meshes, expert_fqns)

    if meshes.pp is None:
        parallel = Parallelized([finish(model)], None, expert_fqns)
        if on_meta:
            parallel.modules[0].to_empty(device=device)
        if on_meta and init:
            torch.manual_seed(cfg.training.seed)
            fs.init_params(parallel.modules[0], init_module)
        return parallel
    param_dtype = mp_policy(cfg.training.mixed_precision).param_dtype
    runner = build_pipeline(
        model,
        meshes.pp,
        n_microbatches=par.pp_microbatches or dims.pp,
        schedule=par.pp_schedule,
        loss_fn=loss_fn,
        shard_fn=finish,
        virtual_stages=par.pp_virtual_stages,
        activation_dtype=param_dtype or torch.float32,
        sequence_shards=dims.tp if sequence_parallel else 1,
    )
    if on_meta:
        for module in runner.modules:
            module.to_empty(device=device)
    if on_meta and init:  # each stage continues the single process's random stream
        init_stage_params(runner.modules, cfg.training.seed, init_module)
    return Parallelized(list(runner.modules), runner, expert_fqns)


def local_batch(
    inputs: torch.Tensor, targets: torch.Tensor, meshes: Meshes
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of its data-parallel batch: its zig-zag chunks under CP."""
    if meshes.cp is None:
        return inputs, targets
    return split_sequence(inputs, meshes.cp), split_sequence(targets, meshes.cp)


# ------------------------------------------------------------------ the full model
def whole_model(module: nn.Module, meshes: Meshes) -> Assemble:
    """``fs.full_state_dict``'s ``assemble`` for ``module``, one of this rank's modules:
    EP's expert slices gathered across the EP group, then (PP) the stages' states
    exchanged, so that every rank holds the whole model. Every rank calls it, for each
    of its modules in turn (every pp rank runs as many)."""

    def assemble(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        state = whole_experts(module, state)
        if meshes.pp is None:
            return state
        stages: list[Any] = [None] * meshes.pp.size()
        mine = {k: v.cpu() for k, v in state.items()}
        dist.all_gather_object(stages, mine, group=meshes.pp.get_group())
        return {name: value for stage in stages for name, value in stage.items()}

    return assemble


def full_model_state(parallel: Parallelized, meshes: Meshes) -> dict[str, torch.Tensor]:
    """The whole model's state dict, gathered on every rank (tests), by name: each
    module's ``fs.full_state_dict``, assembled by ``whole_model``."""
    state: dict[str, torch.Tensor] = {}
    for module in parallel.modules:
        state.update(fs.full_state_dict(module, whole_model(module, meshes)))
    return {name: state[name] for name in sorted(state)}


def checked_dims(cfg: Config, world_size: int) -> ParallelDims:
    """The layout of ``cfg`` on ``world_size`` ranks with every parallelism's check run
    on it: built once, before any rank starts, and handed to the ranks. The checks of
    the config come first, the world size after, as the user reads them."""
    check_layout(cfg)
    dims = ParallelDims.from_config(cfg, world_size)
    check_ep_ranks(dims.ep, dims.dp_shard * dims.cp)  # dp_shard may be inferred only now
    return dims


def _check_qwen3_5_layout(cfg: Config) -> None:
    """Under cp each Gated DeltaNet chunk's conv reads the last conv_kernel - 1 inputs
    of the chunk before it, which one rank holds whole only if the chunks are that
    long."""
    m, t, p = cfg.model, cfg.training, cfg.parallelism
    history = m.linear_attention.conv_kernel - 1
    if p.cp > 1 and "linear_attention" in m.layer_types and t.seq_len // (2 * p.cp) < history:
        raise ConfigError(
            f"training.seq_len = {t.seq_len} with parallelism.cp = {p.cp}: zig-zag chunks of "
            f"{t.seq_len // (2 * p.cp)} tokens, fewer than model.linear_attention.conv_kernel "
            f"- 1 = {history} (each chunk's conv reads that many inputs of the chunk before)"
        )


def check_layout(cfg: Config) -> None:
    """Each parallelism's check (beside its code) and what they ask of each other, of
    the model and of the batch."""
    m, t, p = cfg.model, cfg.training, cfg.parallelism
    check_tp(m, p.tp)
    micro = p.pp_microbatches or p.pp
    check_pipeline(m.n_layers, p.pp, p.pp_virtual_stages, p.pp_schedule, micro)
    if p.pp > 1 and t.batch_size % micro:
        raise ConfigError(
            f"training.batch_size = {t.batch_size} is not divisible by "
            f"parallelism.pp_microbatches = {micro}"
        )
    if p.pp > 1 and m.tie_embeddings:
        raise ConfigError(
            f"model.tie_embeddings = true with parallelism.pp = {p.pp}: the embedding (first "
            "stage) and the output projection (last stage) would be one parameter on two "
            "stages; untie them or set parallelism.pp = 1"
        )
    if p.pp > 1 and t.grad_accum != 1:
        raise ConfigError(
            "training.grad_accum must be 1 with parallelism.pp > 1: the pipeline's "
            "microbatches (parallelism.pp_microbatches) accumulate instead"
        )
    check_cp(t.seq_len, p.cp)
    if m.attention == "gated":
        _check_qwen3_5_layout(cfg)
    if m.mtp_layers and (p.tp > 1 or p.pp > 1 or p.cp > 1):
        raise ConfigError(
            f"model.mtp_layers = {m.mtp_layers} runs with data and expert parallelism only: "
            "set parallelism.tp, pp and cp to 1 (the MTP depths share the embedding and the "
            "head, which pp puts on different stages, and read the tokens ahead, which cp "
            "puts on other ranks); a Hugging Face folder's depths: --model.mtp_layers 0 "
            "trains without them"
        )
    # sequence parallelism cuts each rank's sequence across tp, and pipeline stages
    # send those shards
    if p.tp > 1 and p.sequence_parallel and (t.seq_len // p.cp) % p.tp:
        raise ConfigError(
            f"training.seq_len / cp = {t.seq_len // p.cp} is not divisible by parallelism.tp "
            f"= {p.tp}: sequence parallelism splits each rank's sequence across tp"
        )
    check_ep(m.moe.num_experts, p.ep, None)  # its ranks: once the world sizes dp_shard
    check_backend_options(cfg)
