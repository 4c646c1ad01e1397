"""The quantized all-gather with its codec compiled, through the runtime's hooks: training
equals the eager codec's bit for bit, and every encode and decode ran as a compiled graph
(the hooks are dynamo-disabled; a compiled function called inside still compiles)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

import flexshard as fs
from flexshard.quant import MXFP8, FP8Blockwise
from flexshard.quant import compiled as qc
from flexshard.testing import TinyTransformer, TransformerConfig, make_batches, run_distributed

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
QCFG = TransformerConfig(vocab=64, dim=64, heads=4, hidden=128, layers=2, seq=16)


def _model(mesh, fmt):
    buckets = []
    for i in range(QCFG.layers):
        mats = [f"layers.{i}.{m}.weight" for m in ("qkv", "proj", "up", "down")]
        tiles = fs.BlockShard((32, 32))
        buckets.append(fs.BucketSpec(mats, placement=tiles, name=f"mat{i}", quant=fmt))
        rest = [f"layers.{i}.{m}.*" for m in ("attn_norm", "mlp_norm")]
        rest += [f"layers.{i}.{m}.bias" for m in ("up", "down", "proj")]
        buckets.append(fs.BucketSpec(rest, name=f"rest{i}"))
    buckets.append(fs.BucketSpec(["embed.*", "norm.*", "head.*"], name="outer"))
    torch.manual_seed(0)
    return fs.flex_shard(TinyTransformer(QCFG), mesh=mesh, buckets=buckets, mp_policy=BF16)


def _train(rank, world_size, formats, steps, compiled_model):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    batches = make_batches(QCFG, steps * world_size, 4)
    out = {}
    for fmt in formats:
        runs = {}
        for mode in ("off", "on"):
            qc.set_compile_mode(mode)
            model = _model(mesh, fmt)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            forward = torch.compile(model.loss) if compiled_model else model.loss
            losses = []
            for step in range(steps):
                tokens, targets = batches[step * world_size + rank]
                loss = forward(tokens, targets)
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            runs[mode] = (losses, {k: v.clone() for k, v in fs.full_state_dict(model).items()})
        off, on = runs["off"], runs["on"]
        out[str(fmt)] = {
            "losses_equal": off[0] == on[0],
            "weights_equal": all(torch.equal(off[1][k], on[1][k]) for k in off[1]),
            "stats": qc.stats(),
        }
        qc.reset()
    return out


def _assert_compiled_everywhere(per_rank):
    for rank_out in per_rank:
        for name, result in rank_out.items():
            assert result["losses_equal"] and result["weights_equal"], name
            stats = result["stats"]
            assert stats["broken"] is None and stats["eager_body_runs"] == 0, (name, stats)
            assert len(stats["entries"]) == 2, stats  # the layers share one encode, one decode
            assert all(e["checked"] and not e["failed"] for e in stats["entries"]), stats
            # forward and backward re-gather of 2 layers x 3 steps ran the decode graph
            assert max(e["calls"] for e in stats["entries"]) >= 12, stats


def test_compiled_gather_through_the_hooks():
    """A training run with the codec compiled equals it eager bit for bit (losses and
    master weights) and the hooks (dynamo-disabled) ran the compiled graphs."""
    _assert_compiled_everywhere(run_distributed(_train, 2, [MXFP8((32, 32))], 3, False))


@pytest.mark.slow
def test_compiled_gather_through_the_hooks_fp8_and_compiled_model():
    formats = [FP8Blockwise((32, 32)), MXFP8((1, 32), "rceil")]
    _assert_compiled_everywhere(run_distributed(_train, 2, formats, 3, False))
    _assert_compiled_everywhere(run_distributed(_train, 2, [MXFP8((32, 32))], 3, True))
