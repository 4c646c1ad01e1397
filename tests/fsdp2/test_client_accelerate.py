"""Hugging Face accelerate 1.15's FSDP2 plugin with flexshard's ``fully_shard`` swapped
in as a user would (accelerate imports it from ``torch.distributed.fsdp`` inside
``fsdp2_prepare_model``), bf16 mixed precision, a tiny Llama from transformers, W = 2
gloo on CPU. accelerate shards every block, the embedding and the tail first, so its
root ``fully_shard(model)`` finds no parameter of its own; FSDP2 still casts the root's
output to ``output_dtype``: the loss comes back bfloat16 under both libraries, and the
training is bitwise FSDP2's."""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch

import flexshard as fs
from flexshard.testing import run_distributed

accelerate = pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

STEPS = 3


def _accelerator(rank: int, world_size: int):
    """An Accelerator in bf16 on the gloo group the harness made."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    os.environ.update(LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1")
    from accelerate import Accelerator

    return Accelerator(mixed_precision="bf16", cpu=True)


def _use_fsdp2_plugin(acc) -> None:
    """accelerate turns its FSDP plugin on for accelerator devices only (state.py sets
    ``distributed_type = FSDP`` for MULTI_GPU and the like, not MULTI_CPU, and falls
    back to MULTI_CPU after a prepare): do on CPU what it does there, before each
    ``prepare``, for both libraries alike."""
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
        reshard_after_forward=True,
    )
    plugin.set_mixed_precision("bf16")
    acc.state.distributed_type = DistributedType.FSDP
    acc.state.fsdp_plugin = plugin
    assert acc.is_fsdp2


def _model() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _train(acc, library: str) -> dict:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _use_fsdp2_plugin(acc)
    if library == "flexshard":  # the one-line swap, where accelerate imports it
        with mock.patch.object(torch.distributed.fsdp, "fully_shard", fs.fully_shard):
            model, opt = acc.prepare(model, opt)
        assert isinstance(model, fs.FlexShardModule), type(model).__mro__
        root_buckets = len(model._flexshard_buckets)
    else:
        model, opt = acc.prepare(model, opt)
        root_buckets = None
    gen = torch.Generator().manual_seed(acc.process_index)
    losses = []
    for _ in range(STEPS):
        ids = torch.randint(0, 64, (2, 16), generator=gen)
        loss = model(input_ids=ids, labels=ids).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    params = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
    return {"losses": losses, "params": params, "root_buckets": root_buckets}


def _run(rank: int, world_size: int) -> dict:
    acc = _accelerator(rank, world_size)
    return {library: _train(acc, library) for library in ("fsdp2", "flexshard")}


def test_accelerate_fsdp2_plugin_bf16_is_fsdp2() -> None:
    for result in run_distributed(_run, 2, timeout=300):
        torch_run, flex = result["fsdp2"], result["flexshard"]
        assert flex["root_buckets"] == 0  # the root has no parameter of its own
        assert [t.dtype for t in torch_run["losses"]] == [torch.bfloat16] * STEPS
        assert [t.dtype for t in flex["losses"]] == [torch.bfloat16] * STEPS
        assert all(torch.equal(a, b) for a, b in zip(torch_run["losses"], flex["losses"]))
        assert torch_run["params"].keys() == flex["params"].keys()
        theirs = flex["params"]
        differ = [n for n, p in torch_run["params"].items() if not torch.equal(p, theirs[n])]
        assert differ == []
        # the steps trained: FSDP2's parameters moved from the initial ones
        start = dict(_model().named_parameters())
        assert all(not torch.equal(start[n], p) for n, p in torch_run["params"].items())
