"""The public surface: FSDP2's names (so the one-line import swap covers what FSDP2
users import beside ``fully_shard``) plus what flexshard adds, and nothing else; both
entry points take the mesh by keyword; ``fully_shard`` takes every argument torch's does."""

from __future__ import annotations

import inspect

import torch
import torch.distributed.fsdp as torch_fsdp

import flexshard
import flexshard.placements

# torch.distributed.fsdp's names for fully_shard (FSDP1's classes are not FSDP2's API)
FSDP2_NAMES = {
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "FSDPModule",
    "GradientReductionHandle",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "UnshardHandle",
    "fully_shard",
    "register_fsdp_forward_method",
    "share_comm_ctx",
}
FLEXSHARD_NAMES = {
    "flex_shard",
    "BucketSpec",
    "FlexShardModule",
    "Placement",
    "Shard",
    "FlatShard",
    "Owned",
    "BlockShard",
    "Replicate",
    "CollectiveError",
    "clip_grad_norm_",
    "init_params",
    "distribute_tensor",
    "full_state_dict",
    "load_full_state_dict",
}


#: FSDP2's names an older supported torch lacks (flexshard gives its own there)
NEWER = {"DataParallelMeshDims": "2.13", "GradientReductionHandle": "2.15"}


def test_top_level_is_fsdp2_plus_what_flexshard_adds() -> None:
    assert set(flexshard.__all__) == FSDP2_NAMES | FLEXSHARD_NAMES
    for name in FSDP2_NAMES:  # the very objects torch exports, where flexshard does not replace one
        if not hasattr(torch_fsdp, name):
            assert torch.__version__ < NEWER[name], f"torch.distributed.fsdp no longer has {name}"
        elif name not in ("fully_shard", "share_comm_ctx"):
            assert getattr(flexshard, name) is getattr(torch_fsdp, name), name
    torch_fsdp2 = {n for n in torch_fsdp.__all__ if n in FSDP2_NAMES or n in NEWER}
    assert torch_fsdp2 <= set(flexshard.__all__), "a name FSDP2 exports that flexshard lacks"


def test_placements_package_exports_placements_only() -> None:
    assert set(flexshard.placements.__all__) == {
        "Placement",
        "Region",
        "Shard",
        "FlatShard",
        "Owned",
        "BlockShard",
        "Replicate",
    }


def _keyword_only(fn: object) -> set[str]:
    params = inspect.signature(fn).parameters.values()  # type: ignore[arg-type]
    return {p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}


def test_mesh_by_keyword_in_both_entry_points() -> None:
    for entry in (flexshard.flex_shard, flexshard.fully_shard):
        positional = [
            p.name
            for p in inspect.signature(entry).parameters.values()
            if p.kind is not inspect.Parameter.KEYWORD_ONLY
        ]
        assert positional == ["module"], entry.__name__
        assert "mesh" in _keyword_only(entry)


def test_fully_shard_takes_every_argument_torch_takes() -> None:
    missing = _keyword_only(torch_fsdp.fully_shard) - _keyword_only(flexshard.fully_shard)
    assert not missing, f"flexshard.fully_shard lacks torch's {sorted(missing)}"
