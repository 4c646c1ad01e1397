"""torchtitan 0.3.0's llama3 debug model on CPU gloo, through torchtitan's own
``parallelize_llama`` (its ``apply_fsdp_to_decoder`` calls ``fully_shard`` with
``dp_mesh_dims`` under the ``full_dtensor`` backend), with FSDP2 or flexshard's
``fully_shard`` swapped in at torchtitan's import site, as a user would. Shared by
``tests/fsdp2/test_client_torchtitan.py`` and ``benchmarks/bench_clients.py``; torchtitan
(the ``bench`` extra) is imported when a function here is called, not with this module.

torchtitan needs small CPU patches, applied here and checked, never in torchtitan:

* ``torchtitan.tools.utils.device_type`` (and the copy ``parallel_dims`` imported) is
  "cuda" on a machine without one: set to "cpu", so meshes and ``fully_shard`` use CPU.
* FlexAttention has no backward on CPU (torch 2.13): the debug model's attention
  (causal: one document per sequence, positions 0..L-1) runs as torch's causal
  ``scaled_dot_product_attention`` instead, for both libraries alike.
* torchtitan sets every FSDP module's gradient divide factor to 1 (it divides by the
  global token count itself); FSDP2 then reduces with ``ReduceOp.PREMUL_SUM(1)``,
  which gloo lacks. ``set_force_sum_reduction_for_comms(True)`` on every FSDP module
  after ``parallelize`` makes it a SUM (the same numbers), for both libraries alike.
* ``datasets`` is imported by torchtitan's trainer module (its data loaders) but not
  used on this path; where it is not installed a stub that raises if called stands in
  (the real one pins ``huggingface_hub<2``, which the test extra's transformers refuses).
"""

from __future__ import annotations

import sys
import types
from contextlib import nullcontext
from typing import Any
from unittest import mock

import torch
from torch import nn

SEQ = 64
BATCH = 2
VOCAB = 2048  # the debug model's


def _unused(*_args: Any, **_kwargs: Any) -> Any:
    raise RuntimeError("the datasets stub stands in for an import torchtitan does not use here")


def apply_cpu_patches() -> list[str]:
    """Apply the CPU patches; return what was patched (checked, so a torchtitan that
    changed where these live fails here, not with a CUDA error later)."""
    applied = []
    try:
        import datasets  # noqa: F401
    except ImportError:
        stub, sub = types.ModuleType("datasets"), types.ModuleType("datasets.distributed")
        stub.__path__ = []  # a package: torchtitan imports datasets.distributed
        stub.Dataset = type("Dataset", (), {})
        stub.IterableDataset = type("IterableDataset", (), {})
        stub.load_dataset = _unused
        sub.split_dataset_by_node = _unused
        sys.modules.update({"datasets": stub, "datasets.distributed": sub})
        applied.append("datasets stub")
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.tools.utils as tt_utils

    for module in (tt_utils, parallel_dims):
        if module.device_type != "cpu":
            module.device_type = "cpu"
            applied.append(f"{module.__name__}.device_type = 'cpu'")
    assert tt_utils.device_type == parallel_dims.device_type == "cpu"
    from torchtitan.models.common.attention import FlexAttention

    if FlexAttention._compiled_flex_attn is not _causal_sdpa:
        FlexAttention._compiled_flex_attn = _causal_sdpa
        applied.append("FlexAttention -> causal scaled_dot_product_attention")
    return applied


def _causal_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    score_mod: Any,
    block_mask: Any,
    scale: float | None,
    enable_gqa: bool,
    return_aux: Any,
    **_: Any,
) -> tuple[torch.Tensor, None]:
    """FlexAttention's call, for the causal mask with no score_mod and no lse."""
    if score_mod is not None or return_aux.lse or return_aux.max_scores:
        raise NotImplementedError("the CPU attention patch covers causal attention only")
    if block_mask is None or block_mask.seq_lengths != (q.shape[-2], k.shape[-2]):
        raise NotImplementedError(f"unexpected block mask {block_mask}")
    out = nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa
    )
    return out, None


class Run:
    """A parallelized debug model and what its train step needs."""

    def __init__(self, model: nn.Module, dims: Any, world_size: int) -> None:
        from torchtitan.components.loss import CrossEntropyLoss

        self.model, self.dims, self.world_size = model, dims, world_size
        self.loss = CrossEntropyLoss(CrossEntropyLoss.Config())


def build(world_size: int, library: str, bf16: bool) -> Run:
    """The debug model, parallelized by torchtitan (FSDP over every rank), initialised
    from one seed. ``library``: "fsdp2" or "flexshard" (swapped in for torchtitan)."""
    apply_cpu_patches()
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.llama3 import model_registry

    parallelism = ParallelismConfig(
        data_parallel_shard_degree=world_size, spmd_backend="full_dtensor"
    )
    dims = ParallelDims(
        dp_replicate=1,
        dp_shard=world_size,
        cp=1,
        tp=1,
        pp=1,
        ep=1,
        world_size=world_size,
        spmd_backend="full_dtensor",
    )
    dims.build_mesh()
    dist_utils.set_spmd_backend("full_dtensor")  # as torchtitan's Trainer does
    model = parallelized(
        model_registry("debugmodel", attn_backend="flex"),
        dims,
        parallelism,
        library,
        "bfloat16" if bf16 else "float32",
    )
    return Run(model, dims, world_size)


def parallelized(
    spec: Any, dims: Any, parallelism: Any, library: str, param_dtype: str
) -> nn.Module:
    """A torchtitan model spec's model, built on meta and parallelized by its own
    ``parallelize_fn`` over ``dims`` with FSDP2's or flexshard's ``fully_shard`` at
    torchtitan's import site, then materialised on the CPU and initialised from one seed."""
    apply_cpu_patches()
    import torchtitan.distributed.fsdp as tt_fsdp
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import CompileConfig, TrainingConfig

    import flexshard as fs

    spec.model.update_from_config(config=types.SimpleNamespace(parallelism=parallelism))
    with torch.device("meta"):
        model = spec.model.build()
    swap = (
        mock.patch.object(tt_fsdp, "fully_shard", fs.fully_shard)
        if library == "flexshard"
        else nullcontext()
    )
    with swap:
        model = spec.parallelize_fn(
            model,
            parallel_dims=dims,
            training=TrainingConfig(mixed_precision_param=param_dtype),
            parallelism=parallelism,
            compile_config=CompileConfig(),
            ac_config=None,
            dump_folder="/tmp/torchtitan_cpu",
        )
    sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
    assert sharded, "torchtitan applied no fully_shard"
    for m in sharded:  # gloo has no PREMUL_SUM: see the module docstring
        m.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


def batches(rank: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each rank its own token ids (data parallel), the same for both libraries."""
    gen = torch.Generator().manual_seed(1234 + rank)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
        out.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    return out


def train_step(
    run: Run, opt: torch.optim.Optimizer, inputs: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
    """torchtitan's step without its Trainer's data loading, logging and checkpoints:
    its input wrapping (``full_dtensor.parallelize_inputs``), forward, its loss over
    the global token count, backward, gradient clipping, optimizer step."""
    from torchtitan.distributed import full_dtensor

    # as the Trainer's post_dataloading_process: positions, flex attention's masks
    positions = torch.arange(inputs.shape[1]).expand_as(inputs).contiguous()
    extra = {"positions": positions}
    extra["attention_masks"] = run.model.get_attention_masks(positions=positions)
    inputs, labels, extra = full_dtensor.parallelize_inputs(run.dims, inputs, labels, extra)
    tokens = torch.tensor(float(labels.numel()))  # every rank the same count
    pred = run.model(inputs, **extra)
    loss, _ = run.loss(pred, labels, tokens)
    del pred
    loss.backward()
    torch.nn.utils.clip_grad_norm_(run.model.parameters(), max_norm=1.0)
    opt.step()
    opt.zero_grad()
    return loss.detach()
