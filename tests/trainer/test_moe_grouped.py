"""The MoE layer's grouped experts (``F.grouped_mm`` on padded token groups) against the
Python loop over experts they replaced, and its load balancing (``model.moe.balance``):
the aux-loss-free bias (DeepSeek-V3) and the auxiliary loss, with tokens per expert in
the trainer's metrics, under expert parallelism against one process."""

from __future__ import annotations

import pytest
import torch

from flexshard.testing import run_distributed
from flexshard.trainer.components.metrics import summary_table
from flexshard.trainer.config import ConfigError, config_from_dict
from flexshard.trainer.models.model import MoE, Transformer, init_weights
from flexshard.trainer.models.moe import (
    GROUP_ALIGN,
    LoadBalance,
    _padded_rows,
    grouped_mm_runs,
    grouped_swiglu,
    loop_swiglu,
    step_balance,
    tokens_per_expert,
)
from flexshard.trainer.train import loss_fn, setup, train_step

from .test_parallel_layouts import LOSS_RTOL, MOE, layout_config

# grouped vs loop, as a multiple of the dtype's epsilon times the largest |reference|
# entry: the CPU kernel's fp32 blocking differs from the loop's matmuls (measured 1.1
# eps in the op's outputs, 0.6 eps in the model's; gradients and bf16 bitwise); the
# bound: 4 eps (a few ulps)
ULPS = 4
# the aux loss's gradient injected at the layer's output vs added to the loss: the
# backward sums the same terms in another order (measured 5.8 eps, ffn_norm.weight)
AUX_ULPS = 16


def _rel_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| in units of eps(b.dtype) * max |b|."""
    scale = torch.finfo(b.dtype).eps * float(b.float().abs().max())
    return float((a.float() - b.float()).abs().max()) / scale


def moe_config(**moe: object):
    table = {"model": {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2}}
    table["model"]["moe"] = {**MOE, **moe}
    return config_from_dict(table).model


def _gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def test_padded_rows_align_every_group():
    counts = torch.tensor([5, 0, 17, 16, 1])
    index, ends, total = _padded_rows(counts)
    starts = [0, *ends[:-1].tolist()]
    assert total == int(ends[-1]) == 16 + 0 + 32 + 16 + 16 and ends.dtype == torch.int32
    assert all(s % GROUP_ALIGN == 0 for s in starts)
    expected = [s + i for s, c in zip(starts, counts.tolist()) for i in range(c)]
    assert index.tolist() == expected  # each group's rows in order at its aligned start


@pytest.mark.parametrize("limit", [None, 0.5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_matches_loop(dtype, limit):
    """The op: outputs and gradients (rows, w1, w2, w3); groups of 0, 1, 17 and 40 rows;
    with DeepSeek-V4's clamp (``limit``) too."""
    gen = torch.Generator().manual_seed(0)
    counts = [17, 0, 1, 40]
    x = torch.randn(sum(counts), 24, generator=gen).to(dtype)
    w1, w3 = (0.2 * torch.randn(4, 40, 24, generator=gen) for _ in range(2))
    w2 = 0.2 * torch.randn(4, 24, 40, generator=gen)
    probe = torch.randn(sum(counts), 24, generator=gen).to(dtype)
    assert grouped_mm_runs(x, w1)  # (16-byte rows: 24 and 40 of fp32 or bf16)
    assert not grouped_mm_runs(x, w1[:, :20]) or dtype == torch.float32  # bf16 rows of 40 B
    results = []
    for fn in (grouped_swiglu, loop_swiglu):
        leaves = [t.to(dtype).requires_grad_() for t in (x, w1, w2, w3)]
        out = fn(leaves[0], counts, *leaves[1:], limit)
        (out * probe).sum().backward()
        results.append([out.detach()] + [t.grad for t in leaves])
    if limit is not None:  # the clamp bites: not the unclamped result
        unclamped = grouped_swiglu(x, counts, *(w.to(dtype) for w in (w1, w2, w3)))
        assert not torch.allclose(results[0][0], unclamped)
    gaps = [_rel_gap(a, b) for a, b in zip(*results)]
    print(dtype, gaps)
    assert max(gaps) <= ULPS, gaps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_grouped_matches_loop(dtype):
    """The whole MoE model: logits and every gradient, grouped experts vs the loop."""
    cfg = moe_config()
    batch = torch.randint(0, 256, (2, 25), generator=torch.Generator().manual_seed(1))
    results = []
    for grouped in (True, False):
        model = Transformer(cfg)
        init_weights(model, 5)
        model.to(dtype)
        for module in model.modules():
            if hasattr(module, "grouped"):
                module.grouped = grouped
        logits = model(batch[:, :-1])
        loss_fn(logits, batch[:, 1:]).backward()
        results.append((logits.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (logits, grads), (ref_logits, ref_grads) = results
    gaps = [_rel_gap(logits, ref_logits)] + [_rel_gap(grads[n], ref_grads[n]) for n in grads]
    print(dtype, max(gaps))
    assert max(gaps) <= ULPS, gaps


def test_bias_selects_and_updates():
    """The bias moves the top-k choice only; the update is sign(mean - load) * rate."""
    balance = LoadBalance("bias", 4, bias_rate=0.5, aux_coef=0.0)
    scores = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.1, 0.5, 0.3, 0.1]])
    weights, chosen = balance.select(scores, 2)
    assert chosen.tolist() == [[0, 1], [1, 2]]
    balance.account(weights, scores, chosen)  # load [1, 2, 1, 0], mean 1
    balance.step()
    assert balance.last_load == [1, 2, 1, 0]
    assert balance.bias.tolist() == [0.0, -0.5, 0.0, 0.5]
    weights, chosen = balance.select(scores, 2)
    assert chosen.tolist() == [[3, 0], [3, 2]]  # the biased choice ...
    assert torch.equal(weights, scores.gather(1, chosen))  # ... with unbiased weights
    with pytest.raises(ValueError, match="model.moe.balance = 'loss'"):
        LoadBalance("loss", 4, 0.0, 0.0)


def test_aux_loss_gradient_is_the_loss_plus_aux():
    """balance = "aux": the gradients are those of CE + coef * E * sum(f * P)."""
    cfg = moe_config(balance="aux", aux_loss_coef=0.5)
    batch = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(2))
    grads = []
    for explicit in (False, True):
        model = Transformer(cfg)
        init_weights(model, 5)
        aux: list[torch.Tensor] = []
        if explicit:  # the same layers without the injected gradient, the aux loss by hand
            for module in model.modules():
                if isinstance(module, MoE):
                    module.balance.mode = "none"
                    module.router.register_forward_hook(_collect_aux(aux, cfg.moe))
        loss = loss_fn(model(batch[:, :-1]), batch[:, 1:])
        (loss + sum(aux)).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    router = "layers.1.feed_forward.router.weight"
    aux_gaps = {n: _rel_gap(grads[0][n], grads[1][n]) for n in grads[0]}
    assert max(aux_gaps.values()) <= AUX_ULPS, aux_gaps
    plain = Transformer(moe_config())
    init_weights(plain, 5)
    loss_fn(plain(batch[:, :-1]), batch[:, 1:]).backward()
    assert _gap(plain.get_parameter(router).grad, grads[0][router]) > 1e-4  # it acts


def _collect_aux(aux: list[torch.Tensor], moe):
    return lambda module, args, out: aux.append(_aux(out, moe))


def _aux(logits: torch.Tensor, moe) -> torch.Tensor:
    scores = logits.float().softmax(-1)
    chosen = scores.topk(moe.top_k, dim=-1).indices
    fraction = torch.bincount(chosen.reshape(-1), minlength=moe.num_experts) / chosen.numel()
    return moe.aux_loss_coef * moe.num_experts * (fraction * scores.mean(0)).sum()


# ------------------------------------------------------------------ the trainer, EP
BIAS = {"balance": "bias", "bias_update_rate": 0.05}
BIAS_STEPS = 4


def _train(rank: int, world_size: int, folder: str) -> dict:
    """balance = "bias" for BIAS_STEPS steps: dp2 x ep2, or one rank with the whole batch."""
    parallelism = {"dp_shard": world_size, "ep": world_size}
    batch = {"batch_size": 4 // world_size, "steps": BIAS_STEPS}
    job = setup(
        layout_config(f"{folder}/w{world_size}", parallelism, {**MOE, **BIAS}, training=batch)
    )
    losses, loads, history = [], [], []
    for step in range(BIAS_STEPS):
        losses.append(train_step(job, step)[0])
        loads.append(tokens_per_expert(job.parallel.modules))
        history.append([m.balance.bias.tolist() for m in job.model.modules() if isinstance(m, MoE)])
    return {"losses": losses, "loads": loads, "biases": history[-1], "history": history}


def test_bias_balance_under_ep_matches_one_rank(tmp_path):
    """The bias follows the global load: dp2 x ep2 (each rank its own tokens) trains as
    one rank on the whole batch, and every rank keeps the same bias."""
    two = run_distributed(_train, 2, str(tmp_path), timeout=300)
    (one,) = run_distributed(_train, 1, str(tmp_path), timeout=300)
    gap = max(abs(a - b) / b for a, b in zip(two[0]["losses"], one["losses"]))
    print(f"dp2xep2 vs one rank, balance=bias: loss gap {gap:.2e}")
    assert gap < LOSS_RTOL, gap
    assert two[0]["biases"] == two[1]["biases"] == one["biases"]
    assert two[0]["loads"] == two[1]["loads"] == one["loads"]
    # the bias moved (a step's update can undo the last one: a flipped selection flips
    # the load, so look at every step)
    assert any(b != 0.0 for layers in one["history"] for b in layers[0]), one["history"]
    # the global batch's routed rows: 4 sequences x 16 tokens x top-2, each step
    for loads in one["loads"]:
        assert [sum(v) for v in loads.values()] == [4 * 16 * MOE["top_k"]] * len(loads)
    spread = [sum(max(v) - min(v) for v in loads.values()) for loads in one["loads"]]
    print(f"tokens per expert, step 1 {one['loads'][0]}, step {BIAS_STEPS} {one['loads'][-1]}")
    print(f"max - min load, summed over the layers, by step: {spread}")


def test_step_balance_without_moe_is_a_no_op():
    dense = Transformer(config_from_dict({}).model)
    step_balance([dense])
    assert tokens_per_expert([dense]) == {}


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_moe_matches_eager(dtype):
    """torch.compile (aot_eager): bf16 keeps grouped_mm; fp32 falls back to the loop
    (the op's meta function takes bf16 only). Outputs, loads and biases as eager's."""
    runs = []
    for compiled in (False, True):
        moe = MoE(moe_config(**BIAS), 0.02)
        init_weights(moe, 0)
        moe.to(dtype)
        run = torch.compile(moe, backend="aot_eager") if compiled else moe
        x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1)).to(dtype)
        steps = []
        for _ in range(2):
            out = run(x)
            out.float().sum().backward()
            step_balance([moe])
            steps.append((out.detach(), moe.balance.bias.clone(), moe.balance.last_load))
        runs.append(steps)
    for (out, bias, load), (c_out, c_bias, c_load) in zip(*runs):
        assert _rel_gap(c_out, out) <= ULPS and torch.equal(c_bias, bias) and c_load == load


def test_balance_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="model.moe.balance = 'loss': must be one of"):
        moe_config(balance="loss")
    with pytest.raises(ConfigError, match="bias_update_rate and aux_loss_coef must be >= 0"):
        moe_config(bias_update_rate=-1.0)
    with pytest.raises(ConfigError, match="parallelism.cp_method = 'rings': must be one of"):
        config_from_dict({"parallelism": {"cp_method": "rings"}})


def test_summary_table_reports_the_expert_load():
    record = {"step": 1, "loss": 2.0, "tokens_per_s": 1.0, "mfu": 0.0, "peak_memory_mb": 1.0}
    record |= {"grad_norm": 1.0, "tokens_per_expert": {"a": [1, 3], "b": [6, 2]}}
    assert "expert load max/mean   1.50 (last step, worst layer)" in summary_table([record], {})
