"""A user's model with a parameter that never gets a gradient: Hugging Face's
``BertModel`` trained on its last hidden state leaves the pooler unused on every rank.
With one import changed (flexshard's ``fully_shard`` for torch's), training matches
torch FSDP2 bit for bit: losses and parameters, the pooler's gradient None on both and
its weights untouched by AdamW's weight decay (flexshard once decayed them)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from transformers import BertConfig, BertModel

import flexshard as fs
from flexshard.testing import run_distributed

CONFIG = BertConfig(
    vocab_size=128,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=64,
    max_position_embeddings=32,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)


def _train(rank: int, shard, mesh) -> dict:
    torch.manual_seed(0)
    model = BertModel(CONFIG)
    for layer in model.encoder.layer:
        shard(layer, mesh=mesh)
    shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    pooler = model.pooler.dense.weight.full_tensor().clone()
    losses, none = [], []
    for step in range(3):
        ids = torch.randint(
            0, 128, (2, 8), generator=torch.Generator().manual_seed(10 * step + rank)
        )
        loss = model(input_ids=ids).last_hidden_state.square().mean()
        loss.backward()
        none.append(sorted(n for n, p in model.named_parameters() if p.grad is None))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = {n: p.full_tensor() for n, p in model.named_parameters()}
    return {
        "losses": losses,
        "params": params,
        "grad_none": none,
        "pooler_moved": not torch.equal(params["pooler.dense.weight"], pooler),
    }


def _both(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    return {
        "fsdp2": _train(rank, torch_fully_shard, mesh),
        "flexshard": _train(rank, fs.fully_shard, mesh),
    }


@pytest.mark.parametrize("world", [2, 3])
def test_bert_unused_pooler_matches_fsdp2(world: int) -> None:
    for out in run_distributed(_both, world):
        theirs, ours = out["fsdp2"], out["flexshard"]
        assert ours["losses"] == theirs["losses"]
        assert ours["grad_none"] == theirs["grad_none"]
        assert ours["grad_none"][0] == ["pooler.dense.bias", "pooler.dense.weight"]
        assert not ours["pooler_moved"] and not theirs["pooler_moved"]
        differ = [
            n for n in theirs["params"] if not torch.equal(theirs["params"][n], ours["params"][n])
        ]
        assert differ == []
