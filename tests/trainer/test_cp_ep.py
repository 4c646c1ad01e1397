"""Context parallelism (zig-zag, all-gathered K/V) and expert parallelism (all-to-all
dispatch) against the single-process model: loss and gradients of one step, then a few
training steps composed with flexshard data parallelism (cp2 x dp2 on the flattened
dp_shard_cp mesh; dp_shard 4 x ep 2 with the expert weights sharded over
dp_shard_mod_ep), with bad inputs rejected before any collective."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import flexshard as fs
from flexshard.testing import run_distributed
from flexshard.trainer.config import ModelConfig, config_from_dict
from flexshard.trainer.models.model import Transformer, init_module, init_weights
from flexshard.trainer.parallel.context_parallel import (
    apply_cp,
    check_cp,
    local_positions,
    split_sequence,
)
from flexshard.trainer.parallel.expert_parallel import (
    apply_ep,
    check_ep,
    slice_expert_weights,
    whole_experts,
)
from flexshard.trainer.train import loss_fn

SEED = 5
SEQ = 24  # divisible by 2 * cp for cp = 2, 3 (and 4)
# fp32: one rank's sum over a zig-zag shard vs one process's sum over the whole
# sequence / batch rounds differently. Measured worst gaps are in the report of each
# case (printed with -s); these bounds leave ~10x room.
GRAD_ATOL = 1e-6
LOSS_RTOL = 1e-6
TRAIN_LOSS_RTOL = 2e-6  # 4 AdamW steps with clipping; measured <= 2e-7
PARAM_ATOL = 1e-5  # measured <= 1.1e-6 (AdamW moves each weight by ~lr = 3e-3 a step)
# bf16 model (the logits still match bit for bit): the K/V gradients of the ranks and
# the DP average are summed in bf16. Measured 2.4e-4.
BF16_GRAD_ATOL = 2e-3
STEPS = 4
MAX_NORM = 0.4  # acts on every step: the gradient norms are 0.43-0.63


def model_config(num_experts: int = 0) -> ModelConfig:
    moe = {"num_experts": num_experts, "top_k": 2, "expert_hidden": 24, "first_dense_layers": 1}
    table = {"model": {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "moe": moe}}
    return config_from_dict(table).model


def tokens(batch: int, seq: int = SEQ + 1) -> torch.Tensor:
    return torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(11))


def reference(
    cfg: ModelConfig, batch: torch.Tensor, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, float, dict]:
    """The single process: logits and loss of the whole batch, every parameter's gradient."""
    model = Transformer(cfg)
    init_weights(model, SEED)
    model.to(dtype)
    logits = model(batch[:, :-1])
    loss = loss_fn(logits, batch[:, 1:])
    loss.backward()
    return logits.detach(), loss.item(), {n: p.grad for n, p in model.named_parameters()}


def _average(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    tensor = tensor.detach().clone()
    dist.all_reduce(tensor, op=dist.ReduceOp.AVG, group=group)
    return tensor


def _gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_zigzag_positions_partition_the_sequence_with_equal_work(cp):
    seq = 8 * cp
    per_rank = [local_positions(seq // cp, rank, cp, torch.device("cpu")) for rank in range(cp)]
    assert torch.equal(torch.cat(per_rank).sort().values, torch.arange(seq))
    # causal attention costs (position + 1) key reads per query: the same on every rank
    assert len({int((p + 1).sum()) for p in per_rank}) == 1
    contiguous_cost = [sum(range(r * seq // cp + 1, (r + 1) * seq // cp + 1)) for r in range(cp)]
    assert cp == 1 or len(set(contiguous_cost)) == cp  # what zig-zag avoids


# ------------------------------------------------------------------ one step, no DP
def cp_step(
    cp_group: dist.ProcessGroup, num_experts: int = 0, dtype: torch.dtype = torch.float32
) -> dict[str, float]:
    """CP over ``cp_group`` (every rank has the whole batch): loss and gradients. With
    experts, EP runs over the same ranks (EP borrows the CP ranks, as torchtitan)."""
    cfg, batch = model_config(num_experts), tokens(2)
    ref_logits, ref_loss, ref_grads = reference(cfg, batch, dtype)
    model = Transformer(cfg)
    init_weights(model, SEED)
    model.to(dtype)
    apply_cp(model, cp_group)
    experts = slice(None)
    if num_experts:
        apply_ep(model, cp_group)
        local = num_experts // dist.get_world_size(cp_group)
        experts = slice(local * dist.get_rank(cp_group), local * (dist.get_rank(cp_group) + 1))
    inputs, targets = (split_sequence(t, cp_group) for t in (batch[:, :-1], batch[:, 1:]))
    logits = model(inputs)
    # bitwise: each query row sees the same keys, in the same (global) order, as in one
    # process, and each expert computes a token's row alone; only reductions differ
    assert torch.equal(logits, split_sequence(ref_logits, cp_group))
    loss = loss_fn(logits, targets)
    loss.backward()
    # every CP rank holds the same number of tokens: the global mean is the ranks' mean
    loss_gap = abs(float(_average(loss, cp_group)) - ref_loss) / ref_loss
    grad_gap = max(
        _gap(p.grad, ref_grads[n][experts])
        if ".experts." in n  # EP: already the global mean's gradient
        else _gap(_average(p.grad.float(), cp_group), ref_grads[n])
        for n, p in model.named_parameters()
    )
    bf16 = dtype == torch.bfloat16
    assert loss_gap < LOSS_RTOL, loss_gap  # the loss is computed in fp32
    assert grad_gap < (BF16_GRAD_ATOL if bf16 else GRAD_ATOL), grad_gap
    return {"loss_gap": loss_gap, "grad_gap": grad_gap}


def ep_step(ep_group: dist.ProcessGroup, num_experts: int, meta: bool) -> dict[str, float]:
    """EP over ``ep_group``, each rank with its own rows of the batch."""
    cfg = model_config(num_experts)
    ep, rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
    batch = tokens(2 * ep)
    ref_logits, ref_loss, ref_grads = reference(cfg, batch)
    with torch.device("meta" if meta else "cpu"):
        model = Transformer(cfg)
    if not meta:
        init_weights(model, SEED)
    sliced = apply_ep(model, ep_group)
    assert sliced == ["layers.1.feed_forward.experts"]
    if meta:  # the trainer's path: build on meta, split, then draw (all experts, keep ours)
        model.to_empty(device="cpu")
        init_weights(model, SEED)
    local = num_experts // ep
    experts = slice(rank * local, (rank + 1) * local)
    single = Transformer(cfg)
    init_weights(single, SEED)
    for (name, p), q in zip(model.named_parameters(), single.parameters()):
        assert torch.equal(p, q[experts] if ".experts." in name else q), name
    mine = batch[2 * rank : 2 * rank + 2]
    logits = model(mine[:, :-1])
    assert torch.equal(logits, ref_logits[2 * rank : 2 * rank + 2])  # bitwise, as for CP
    loss = loss_fn(logits, mine[:, 1:])
    loss.backward()
    loss_gap = abs(float(_average(loss, ep_group)) - ref_loss) / ref_loss
    gaps = {}
    for name, p in model.named_parameters():
        if ".experts." in name:  # already the global mean's gradient (scaled by 1 / ep)
            gaps[name] = _gap(p.grad, ref_grads[name][experts])
        else:  # replicated: averaged over the ranks as data parallelism does
            gaps[name] = _gap(_average(p.grad, ep_group), ref_grads[name])
    grad_gap = max(gaps.values())
    assert loss_gap < LOSS_RTOL and grad_gap < GRAD_ATOL, (loss_gap, gaps)
    return {"loss_gap": loss_gap, "grad_gap": grad_gap}


def bad_inputs(world_group: dist.ProcessGroup) -> None:
    """Errors name the cause before any collective runs."""
    with pytest.raises(ValueError, match="seq_len = 20 is not divisible by 2 \\* parallelism.cp"):
        check_cp(20, 3)
    with pytest.raises(ValueError, match="not divisible by 2 \\* parallelism.cp"):
        split_sequence(tokens(1, 10), world_group)
    with pytest.raises(TypeError, match="cp_mesh must be"):
        split_sequence(tokens(1), "cp")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_experts = 5 is not divisible by parallelism.ep"):
        check_ep(5, 2, 4)
    with pytest.raises(ValueError, match="must divide dp_shard \\* cp = 3"):
        check_ep(4, 2, 3)
    with pytest.raises(ValueError, match="needs a mixture-of-experts"):
        check_ep(0, 2, 2)
    with torch.device("meta"):
        moe = Transformer(model_config(num_experts=5))
        dense = Transformer(model_config())
        moe_split = Transformer(model_config(num_experts=6))
    apply_ep(moe_split, world_group)
    with pytest.raises(ValueError, match="feed_forward.experts: 5 experts are not divisible"):
        apply_ep(moe, world_group)
    with pytest.raises(ValueError, match="no MoE layer"):
        apply_ep(dense, world_group)
    with torch.device("meta"):
        unsplit = Transformer(model_config(num_experts=4))
    sharded = fs.flex_shard(unsplit, buckets=[fs.BucketSpec("*")])
    with pytest.raises(ValueError, match="already sharded for data parallelism; apply_ep comes"):
        apply_ep(sharded, world_group)
    with pytest.raises(ValueError, match="experts already split by apply_ep"):
        apply_ep(moe_split, world_group)
    with pytest.raises(ValueError, match="no attention that supports CP"):
        apply_cp(nn.Linear(2, 2), world_group)


def _small_cases(rank: int, world_size: int) -> dict[str, dict[str, float]]:
    world = dist.group.WORLD
    bad_inputs(world)
    results = {f"cp{world_size}": cp_step(world)}
    experts = 2 * world_size  # two experts per rank (W = 3: six experts)
    results[f"ep{world_size}"] = ep_step(world, experts, meta=False)
    results[f"ep{world_size}_meta"] = ep_step(world, experts, meta=True)
    if world_size == 2:
        results["cp2+ep2"] = cp_step(world, num_experts=4)
        results["cp2+ep2_bf16"] = cp_step(world, num_experts=4, dtype=torch.bfloat16)
    if world_size == 3:  # odd: flexshard over the 3 CP ranks (dp_shard_cp = 1 x 3)
        results["cp3xdp1"] = cp_dp_training(1, 3)
    return results


@pytest.mark.parametrize("world_size", [2, 3])
def test_cp_and_ep_match_single_process(world_size):
    results = run_distributed(_small_cases, world_size, timeout=300)
    print(results[0])


# ------------------------------------------------------------ training with flexshard
def _train_reference(cfg: ModelConfig, batches: list[torch.Tensor]) -> tuple[list, list, dict]:
    model = Transformer(cfg)
    init_weights(model, SEED)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    losses, norms = [], []
    for batch in batches:
        loss = loss_fn(model(batch[:, :-1]), batch[:, 1:])
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, norms, {n: p.detach() for n, p in model.named_parameters()}


def _train(model: nn.Module, batch_of, steps: int, clip) -> tuple[list, list]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    losses, norms = [], []
    for step in range(steps):
        inputs, targets = batch_of(step)
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        norms.append(float(clip(model)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(_average(loss)))  # equal tokens per rank: the global mean
    return losses, norms


def _compare(name, losses, norms, params, expected) -> dict[str, float]:
    ref_losses, ref_norms, ref_params = expected
    loss_gap = max(abs(a - b) / b for a, b in zip(losses, ref_losses))
    norm_gap = max(abs(a - b) / b for a, b in zip(norms, ref_norms))
    param_gap = max(_gap(params[n], ref_params[n]) for n in ref_params)
    assert loss_gap < TRAIN_LOSS_RTOL and norm_gap < TRAIN_LOSS_RTOL, (name, loss_gap, norm_gap)
    assert param_gap < PARAM_ATOL, (name, param_gap)
    assert losses[-1] < losses[0], name  # it learns
    return {"loss_gap": loss_gap, "norm_gap": norm_gap, "param_gap": param_gap}


def _layer_buckets(cfg: ModelConfig) -> list[fs.BucketSpec]:
    layers = [fs.BucketSpec(f"layers.{i}.*", name=f"layers.{i}") for i in range(cfg.n_layers)]
    return [*layers, fs.BucketSpec(["tok_embeddings.*", "norm.*", "output.*"], name="outer")]


def cp_dp_training(dp: int, cp: int) -> dict[str, float]:
    """cp x dp_shard: flexshard shards over the flattened dp_shard x cp ranks."""
    mesh = init_device_mesh("cpu", (dp, cp), mesh_dim_names=("dp_shard", "cp"))
    dp_cp = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    cfg, dp_rank = model_config(), mesh.get_local_rank("dp_shard")
    batches = [tokens(2 * dp, SEQ + 1 + step)[:, step:] for step in range(STEPS)]
    expected = _train_reference(cfg, batches)
    with torch.device("meta"):
        model = Transformer(cfg)
    apply_cp(model, mesh["cp"])
    model = fs.flex_shard(model, mesh=dp_cp, buckets=_layer_buckets(cfg))
    model.to_empty(device="cpu")
    torch.manual_seed(SEED)
    fs.init_params(model, init_module)

    def batch_of(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        mine = batches[step][2 * dp_rank : 2 * dp_rank + 2]
        return tuple(split_sequence(t, mesh["cp"]) for t in (mine[:, :-1], mine[:, 1:]))

    losses, norms = _train(model, batch_of, STEPS, lambda m: fs.clip_grad_norm_(m, MAX_NORM))
    return _compare(f"cp{cp}xdp{dp}", losses, norms, fs.full_state_dict(model), expected)


def ep_dp_training(rank: int) -> dict[str, float]:
    """dp_shard 4 with ep 2 borrowed from it: expert weights sharded by flexshard over
    dp_shard_mod_ep (2 ranks), everything else over all 4 dp_shard ranks."""
    dp = init_device_mesh("cpu", (4,), mesh_dim_names=("dp_shard",))
    ep_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard_mod_ep", "ep"))
    cfg = model_config(num_experts=4)
    batches = [tokens(8, SEQ + 1 + step)[:, step:] for step in range(STEPS)]
    expected = _train_reference(cfg, batches)
    with torch.device("meta"):
        model = Transformer(cfg)
    sliced = apply_ep(model, ep_mesh["ep"])
    for fqn in sliced:  # experts first, on their own mesh; then blocks and root (FSDP2 style)
        fs.fully_shard(model.get_submodule(fqn), mesh=ep_mesh["dp_shard_mod_ep"])
    for layer in model.layers:
        fs.fully_shard(layer, mesh=dp)
    model = fs.fully_shard(model, mesh=dp)
    model.to_empty(device="cpu")
    torch.manual_seed(SEED)
    fs.init_params(model, init_module)

    def batch_of(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        mine = batches[step][2 * rank : 2 * rank + 2]
        return mine[:, :-1], mine[:, 1:]

    # the expert slices are sharded over dp_shard_mod_ep only: their norm also sums over ep
    expert_params = [p for fqn in sliced for p in model.get_submodule(fqn).parameters()]
    experts = [(expert_params, ep_mesh["ep"])]

    def clip(m: nn.Module) -> torch.Tensor:
        return fs.clip_grad_norm_(m, MAX_NORM, extra_groups=experts)

    losses, norms = _train(model, batch_of, STEPS, clip)
    # the full model: other layers from flexshard, the experts gathered across EP ranks
    params = fs.full_state_dict(model, functools.partial(whole_experts, model))
    result = _compare("dp4_ep2", losses, norms, params, expected)
    # and back: the single-process state dict, sliced to this rank's experts, loads
    # into the sharded EP model and gives the same (local) state dict
    before = fs.full_state_dict(model)
    fs.load_full_state_dict(model, slice_expert_weights(model, expected[2]))
    after = fs.full_state_dict(model)
    for key, value in slice_expert_weights(model, expected[2]).items():
        assert torch.equal(after[key], value), key
    assert any(not torch.equal(before[k], after[k]) for k in after)
    return result


def _training_cases(rank: int, world_size: int) -> dict[str, dict[str, float]]:
    return {
        "ep4": ep_step(dist.group.WORLD, 4, meta=True),  # one expert per rank
        "cp2xdp2": cp_dp_training(2, 2),
        "dp4xep2": ep_dp_training(rank),
    }


def test_cp_and_ep_train_with_flexshard():
    results = run_distributed(_training_cases, 4, timeout=400)
    print(results[0])
