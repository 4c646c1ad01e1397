"""``fully_shard(..., shard_placement_fn=...)`` returning FSDP2's ``ShardPlacementResult``
(torch 2.13 on): each parameter its own placement and mesh, as torchtitan shards a MoE
block's routed experts on the expert-data-parallel mesh and the rest on the dp mesh, in
one call. A small MoE model (experts as 3-D ``[E, D, H]`` weights, Shard(0) and
Shard(1), 17-wide dims that divide no mesh) is sharded by torch's FSDP2 and by flexshard
from the same initial weights and trained with AdamW: losses, gradients and parameters
bit for bit, the sharded DTensors' meshes, placements and shapes, and the collectives
counted per kind equal; a DCP save and load round-trips. The same with torchtitan's
full_dtensor layout: every parameter a DTensor on a full SPMD mesh, the mesh infos built
by torch's ``_get_mesh_info(mesh, dp_mesh_dims)`` (experts Shard(0) over ep, FSDP over
efsdp or HSDP), and torchtitan's own DeepSeek-V3 debug model with expert parallelism
(slow). The mesh infos flexshard cannot map raise naming the parameter."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

import flexshard as fs
from flexshard import DataParallelMeshDims
from flexshard import checkpoint as ckpt
from flexshard.testing import run_distributed
from flexshard.testing.collectives import record_collectives
from flexshard.torch_internals import FSDPMeshInfo, HSDPMeshInfo, ShardPlacementResult

pytestmark = pytest.mark.skipif(
    ShardPlacementResult is None, reason="torch's FSDP2 has no ShardPlacementResult before 2.13"
)

DIM, HIDDEN, EXPERTS, STEPS = 12, 17, 3, 3


class Experts(nn.Module):
    """Every token through every expert, weighted by the router (dense gating)."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(EXPERTS, DIM, HIDDEN) * 0.2)
        self.w2 = nn.Parameter(torch.randn(EXPERTS, HIDDEN, DIM) * 0.2)

    def forward(self, x: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        h = F.relu(torch.einsum("bd,edh->beh", x, self.w1))
        return torch.einsum("be,beh,ehd->bd", gates, h, self.w2)


class MoEBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN)  # 17 rows: uneven on every mesh here
        self.down = nn.Linear(HIDDEN, DIM)
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = Experts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.down(F.relu(self.up(self.norm(x))))
        return h + self.experts(h, torch.softmax(self.router(h), dim=-1))


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MoEBlock() for _ in range(2))
        self.head = nn.Linear(DIM, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _setup(name: str, world: int) -> tuple:
    """(dense mesh, the experts' mesh info, how dense parameters are returned)."""
    dense = init_device_mesh("cpu", (world,))
    if name == "fsdp_dp_submesh":  # torchtitan's shape: experts FSDP over a sub-mesh
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
        return dense, FSDPMeshInfo(mesh["dp"], shard_mesh_dim=0), "result"
    if name == "hsdp":  # experts sharded over ep, replicated over dp
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
        return dense, HSDPMeshInfo(mesh, shard_mesh_dim=1, replicate_mesh_dim=0), "none"
    # W = 3: the experts over every rank too, on a process group of their own
    mesh = DeviceMesh.from_group(dist.new_group(list(range(world))), "cpu")
    return dense, FSDPMeshInfo(mesh, shard_mesh_dim=0), "shard"


def _build(shard, name: str, world: int, seed: int = 0) -> MoE:
    dense, experts_info, dense_kind = _setup(name, world)
    # torchtitan's: the dense parameters' own mesh info object, one per block call
    dense_info = FSDPMeshInfo(dense, shard_mesh_dim=0)
    torch.manual_seed(seed)
    model = MoE()
    for block in model.blocks:
        w1, w2 = block.experts.w1, block.experts.w2

        def placement(p: nn.Parameter, w1=w1, w2=w2) -> object:
            if p is w1:
                return ShardPlacementResult(placement=Shard(1), mesh_info=experts_info)
            if p is w2:  # None: Shard(0), as FSDP2 reads it
                return ShardPlacementResult(placement=None, mesh_info=experts_info)
            if dense_kind == "result":
                return ShardPlacementResult(placement=Shard(0), mesh_info=dense_info)
            return Shard(0) if dense_kind == "shard" else None

        shard(block, mesh=dense, shard_placement_fn=placement)
    shard(model, mesh=dense)
    return model


def _native(name: str, world: int) -> MoE:
    """The same layout said flexshard's way: buckets with a mesh of their own, one per
    block and mesh as FSDP2's parameter groups (the same packing, the same sums)."""
    dense, experts_info, _ = _setup(name, world)
    torch.manual_seed(0)
    model = MoE()
    buckets = []
    for i in range(len(model.blocks)):
        dense_patterns = [f"blocks.{i}.{m}.*" for m in ("norm", "up", "down", "router")]
        buckets.append(fs.BucketSpec(dense_patterns))
        buckets.append(
            fs.BucketSpec(
                f"blocks.{i}.experts.*",
                placement=lambda fqn, p: fs.Shard(1) if fqn.endswith("w1") else fs.Shard(0),
                mesh=experts_info.mesh,
            )
        )
    buckets.append(fs.BucketSpec("head.*"))
    return fs.flex_shard(model, mesh=dense, buckets=buckets)


def _layout(model: nn.Module) -> dict:
    out = {}
    for fqn, p in model.named_parameters():
        mesh = p.device_mesh
        out[fqn] = (
            mesh.mesh.tolist(),
            mesh.mesh_dim_names,
            tuple(p.placements),
            tuple(p.shape),
            tuple(p.to_local().shape),
        )
    return out


def _locals(model: nn.Module, grads: bool = False) -> dict:
    return {
        fqn: (p.grad if grads else p).to_local().detach().clone()
        for fqn, p in model.named_parameters()
    }


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, DIM, generator=gen), torch.randn(4, 5, generator=gen)


def _train(model: MoE, rank: int, start: int = 0) -> tuple[dict, torch.optim.Optimizer]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    out: dict = {"losses": [], "grads": []}
    with record_collectives() as log:
        for step in range(start, start + STEPS):
            x, target = _batch(rank, step)
            loss = F.mse_loss(model(x), target)
            loss.backward()
            out["losses"].append(loss.detach())
            out["grads"].append(_locals(model, grads=True))
            opt.step()
            opt.zero_grad()
    out["counts"] = dict(log.counts())
    out["params"] = _locals(model)
    return out, opt


def _differences(a: dict, b: dict, where: str = "") -> list[str]:
    """Keys whose values are not bitwise equal (tensors), recursively."""
    if isinstance(a, torch.Tensor):
        same = a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        return [] if same else [where]
    if isinstance(a, dict):
        if a.keys() != b.keys():
            return [f"{where} keys"]
        return [d for k in a for d in _differences(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, (list, tuple)) and a and isinstance(a[0], (torch.Tensor, dict)):
        return [
            d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{where}[{i}]")
        ]
    return [] if a == b else [f"{where}: {a} != {b}"]


def _parity(rank: int, world: int, names: list[str], root: str) -> dict:
    out = {}
    for name in names:
        theirs = _build(torch_fully_shard, name, world)
        ours = _build(fs.fully_shard, name, world)
        layout = _layout(theirs)
        their_run, _ = _train(theirs, rank)
        our_run, our_opt = _train(ours, rank)
        result = {
            "layout": _differences(_layout(ours), layout),
            "run": _differences(our_run, their_run),
            "counts": our_run["counts"],
            "their_counts": their_run["counts"],
            "expert_placements": layout["blocks.0.experts.w1"][2],
            "buckets": len(ours.blocks[0]._flexshard_buckets),
        }
        if name == "hsdp":  # flex_shard's own per-bucket meshes: the same numbers
            native = _native(name, world)
            native_run, _ = _train(native, rank)
            del native_run["counts"]  # other buckets, other collectives
            their_run.pop("counts")
            result["native"] = _differences(_layout(native), layout)
            result["native"] += _differences(native_run, their_run)
        if name != "fsdp_dp_submesh":  # experts differ across ep ranks there: not one tensor
            path = os.path.join(root, name)
            state = {"model": ours.state_dict(), "optim": ckpt.optimizer_state_dict(ours, our_opt)}
            dcp.save(state, checkpoint_id=path)
            fresh = _build(fs.fully_shard, name, world, seed=1)
            fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2, weight_decay=0.1)
            fresh_run, _ = _train(fresh, rank)  # optimizer state exists to load into
            loaded = {
                "model": fresh.state_dict(),
                "optim": ckpt.optimizer_state_dict(fresh, fresh_opt),
            }
            dcp.load(loaded, checkpoint_id=path)
            fresh.load_state_dict(loaded["model"])
            ckpt.load_optimizer_state_dict(fresh, fresh_opt, loaded["optim"])
            result["dcp"] = _differences(_locals(fresh), _locals(ours))
            result["dcp"] += _differences(
                ckpt.optimizer_state_dict(fresh, fresh_opt)["state"],
                ckpt.optimizer_state_dict(ours, our_opt)["state"],
            )
        out[name] = result
    return out


def _check(outs: list[dict], names: list[str]) -> None:
    for rank, out in enumerate(outs):
        for name in names:
            result = out[name]
            where = f"rank {rank}, {name}"
            assert result["layout"] == [], where
            assert result["run"] == [], where
            assert result["buckets"] == 2, where  # one per mesh, as FSDP2's param groups
            assert result["counts"].get("reduce_scatter_single", 0) > 0, where
            assert result.get("dcp", []) == [], where
            assert result.get("native", []) == [], where


def test_moe_experts_on_their_own_mesh_w4(tmp_path) -> None:
    names = ["fsdp_dp_submesh", "hsdp"]
    outs = run_distributed(_parity, 4, names, os.fspath(tmp_path))
    _check(outs, names)
    # experts FSDP-sharded over the dp sub-mesh; HSDP: replicated over dp, sharded over ep
    assert outs[0]["fsdp_dp_submesh"]["expert_placements"] == (Shard(1),)
    assert len(outs[0]["hsdp"]["expert_placements"]) == 2
    assert outs[0]["hsdp"]["counts"].get("all_reduce", 0) > 0  # HSDP's replicate reduction
    assert "native" in outs[0]["hsdp"]


def test_moe_experts_on_their_own_mesh_w3(tmp_path) -> None:
    names = ["w3"]
    _check(run_distributed(_parity, 3, names, os.fspath(tmp_path)), names)


# ------------------------------------------------------------------ full SPMD meshes
# torchtitan's full_dtensor expert parallelism: every parameter a DTensor on a full SPMD
# mesh, the dense ones on (dp_replicate?, dp_shard), the routed experts Shard(0) over ep
# on (dp_replicate?, efsdp, ep); each block's shard_placement_fn returns torch's own
# _get_mesh_info(mesh, dims) for both, as torchtitan's apply_fsdp_to_decoder does

EP = 2
SPMD_EXPERTS = 4  # 2 per ep rank
EXPERT_HIDDEN = 10  # FSDP2 shards dim 1 evenly only

#: name -> (dense mesh shape, names, dp dims; sparse mesh shape, names, dp dims; whether
#: the fully_shard calls pass dp_mesh_dims, the dense parameters then DTensors too)
SPMD_SETUPS = {
    # W = 4: dp_shard = 4, ep = 2, efsdp = 2 (experts FSDP over efsdp)
    "fsdp_ep": (
        (4,), ("dp_shard",), DataParallelMeshDims(shard="dp_shard"),
        (2, EP), ("efsdp", "ep"), DataParallelMeshDims(shard="efsdp"), True,
    ),
    # W = 4: dp_replicate = 2, dp_shard = 2, ep = 2, efsdp = 1 (HSDP over dp_replicate)
    "hsdp_ep": (
        (2, 2), ("dp_replicate", "dp_shard"),
        DataParallelMeshDims(shard="dp_shard", replicate="dp_replicate"),
        (2, 1, EP), ("dp_replicate", "efsdp", "ep"),
        DataParallelMeshDims(shard="efsdp", replicate="dp_replicate"), True,
    ),
    # the calls without dp_mesh_dims: dense parameters plain on a 1-D mesh, only the
    # experts' mesh info from dp_mesh_dims
    "experts_only_spmd": (
        (4,), ("dp_shard",), None,
        (2, EP), ("efsdp", "ep"), DataParallelMeshDims(shard="efsdp"), False,
    ),
}  # fmt: skip


def _local(p: torch.Tensor) -> torch.Tensor:
    """What the block computes with: a DTensor parameter's local piece (torchtitan's
    local_map), the gradient flowing back as a DTensor on the parameter's mesh."""
    return p.to_local() if isinstance(p, DTensor) else p


class EPExperts(nn.Module):
    """Routed experts split over ep (Shard(0) on the ep dim): every rank sends its
    tokens to each ep peer (all_to_all), runs its own experts on all of them and sends
    each expert's output back; the router's gates weight them where the tokens live."""

    def __init__(self, mesh: DeviceMesh) -> None:
        super().__init__()
        self.ep_group = mesh.get_group("ep")
        placements = [Replicate()] * mesh.ndim
        placements[-1] = Shard(0)
        shapes = {"w1": (DIM, EXPERT_HIDDEN), "w2": (EXPERT_HIDDEN, DIM)}
        for name, shape in shapes.items():
            full = torch.randn(SPMD_EXPERTS, *shape) * 0.2
            self.register_parameter(name, nn.Parameter(distribute_tensor(full, mesh, placements)))

    def forward(self, x: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        w1, w2 = _local(self.w1), _local(self.w2)  # [experts / ep, ...]
        sent = funcol.all_to_all_single_autograd(
            torch.cat([x] * EP), None, None, self.ep_group
        )  # every ep peer's tokens: [EP * B, D]
        h = F.relu(torch.einsum("bd,edh->beh", sent, w1))
        out = funcol.all_to_all_single_autograd(
            torch.einsum("beh,ehd->bed", h, w2).contiguous(), None, None, self.ep_group
        )  # my tokens through each peer's experts: [EP * B, experts / ep, D]
        out = torch.cat(out.chunk(EP), dim=1)  # [B, experts, D]
        return torch.einsum("be,bed->bd", gates, out)


class SpmdBlock(nn.Module):
    def __init__(self, dense: DeviceMesh | None, sparse: DeviceMesh) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)
        self.router = nn.Linear(DIM, SPMD_EXPERTS, bias=False)
        if dense is not None:  # the dense parameters on the dense SPMD mesh
            _distribute_all(self, dense)
        self.experts = EPExperts(sparse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.norm
        h = F.layer_norm(x, (DIM,), _local(n.weight), _local(n.bias))
        h = F.linear(h, _local(self.up.weight), _local(self.up.bias))
        h = x + F.linear(F.relu(h), _local(self.down.weight), _local(self.down.bias))
        gates = torch.softmax(F.linear(h, _local(self.router.weight)), dim=-1)
        return h + self.experts(h, gates)


class SpmdMoE(nn.Module):
    def __init__(self, dense: DeviceMesh | None, sparse: DeviceMesh) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(SpmdBlock(dense, sparse) for _ in range(2))
        self.head = nn.Linear(DIM, 5)
        if dense is not None:
            _distribute_all(self.head, dense)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return F.linear(x, _local(self.head.weight), _local(self.head.bias))


def _distribute_all(module: nn.Module, mesh: DeviceMesh) -> None:
    for sub in list(module.modules()):
        for name, p in list(sub.named_parameters(recurse=False)):
            placed = distribute_tensor(p.detach(), mesh, [Replicate()] * mesh.ndim)
            sub.register_parameter(name, nn.Parameter(placed))


_MESHES: dict[tuple, DeviceMesh] = {}


def _mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """One mesh object per shape and names in a process: DTensor hands an equal mesh
    built earlier back in a new parameter's spec, and FSDP2 wants the very object."""
    if (shape, names) not in _MESHES:
        _MESHES[shape, names] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _MESHES[shape, names]


def _build_spmd(shard, name: str) -> SpmdMoE:
    dense_shape, dense_names, dense_dims, sparse_shape, sparse_names, sparse_dims, spmd = (
        SPMD_SETUPS[name]
    )
    dense = _mesh(dense_shape, dense_names)
    sparse = _mesh(sparse_shape, sparse_names)
    torch.manual_seed(0)
    model = SpmdMoE(dense if spmd else None, sparse)
    call = {"mesh": dense, "dp_mesh_dims": dense_dims} if spmd else {"mesh": dense}
    for i, block in enumerate(model.blocks):
        # torchtitan's: torch's own builder, one pair of mesh-info objects per block
        edp_info = _get_mesh_info(sparse, sparse_dims)
        dp_info = _get_mesh_info(dense, dense_dims)
        experts = set(block.experts.parameters())
        expert_placement = Shard(0) if i == 0 else Shard(1)  # torchtitan's two choices

        def placement(
            p: nn.Parameter, experts=experts, ep=expert_placement, edp=edp_info, dp=dp_info
        ) -> object:
            if p in experts:
                return ShardPlacementResult(placement=ep, mesh_info=edp)
            if spmd:
                return ShardPlacementResult(placement=Shard(0), mesh_info=dp)
            return None  # the call's mesh

        shard(block, **call, shard_placement_fn=placement)
    shard(model, **call)
    return model


def _spmd_parity(rank: int, world: int, names: list[str]) -> dict:
    out = {}
    for name in names:
        theirs = _build_spmd(torch_fully_shard, name)
        ours = _build_spmd(fs.fully_shard, name)
        layout = _layout(theirs)
        their_run, _ = _train(theirs, rank)
        our_run, _ = _train(ours, rank)
        out[name] = {
            "layout": _differences(_layout(ours), layout),
            "run": _differences(our_run, their_run),
            "counts": our_run["counts"],
            "their_counts": their_run["counts"],
            "expert_layout": (layout["blocks.0.experts.w1"], layout["blocks.1.experts.w1"]),
            "dense_layout": layout["blocks.0.up.weight"],
            "buckets": len(ours.blocks[0]._flexshard_buckets),
        }
    return out


def test_moe_experts_on_spmd_meshes_from_dp_mesh_dims_w4() -> None:
    """torchtitan's full_dtensor EP layout at W = 4: FSDP (dp_shard 4, efsdp 2) and HSDP
    (dp_replicate 2 x dp_shard 2; efsdp 1), the dense parameters also plain on a plain
    mesh: FSDP2's layout, losses, gradients, parameters and collectives exactly."""
    names = list(SPMD_SETUPS)
    outs = run_distributed(_spmd_parity, 4, names, timeout=300)
    for rank, out in enumerate(outs):
        for name in names:
            result, where = out[name], f"rank {rank}, {name}"
            assert result["layout"] == [], (where, result["layout"])
            assert result["run"] == [], (where, result["run"])
            assert result["counts"] == result["their_counts"], where
            assert result["buckets"] == 2, where  # dense and experts, FSDP2's two groups
            assert result["counts"].get("reduce_scatter_single", 0) > 0, where
    # the experts stay on their SPMD mesh, every dim placed (the dp dim strided over ep)
    fsdp = outs[0]["fsdp_ep"]
    (mesh, names0, placements, *_), (_, _, placements1, *_) = fsdp["expert_layout"]
    assert names0 == ("efsdp", "ep")
    assert placements == (_StridedShard(0, split_factor=EP), Shard(0))
    assert placements1 == (Shard(1), Shard(0))
    assert fsdp["dense_layout"][1] == ("dp_shard",)
    hsdp = outs[0]["hsdp_ep"]
    assert hsdp["expert_layout"][0][1] == ("dp_replicate", "efsdp", "ep")
    assert hsdp["expert_layout"][0][2][0] == Replicate()
    assert hsdp["counts"].get("all_reduce", 0) > 0  # HSDP's replicate reduction
    assert outs[0]["experts_only_spmd"]["dense_layout"][2] == (Shard(0),)


# ------------------------------------------------------------------ refused


def _refusals(rank: int, world: int) -> dict:
    from torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("a", "b"))
    dense = init_device_mesh("cpu", (world,))
    cases = {
        "ddp": DDPMeshInfo(mesh["b"], replicate_mesh_dim=0),
        "hsdp_dims_swapped": HSDPMeshInfo(mesh, shard_mesh_dim=0, replicate_mesh_dim=1),
        "fsdp_on_2d_mesh": FSDPMeshInfo(mesh, shard_mesh_dim=1),
        "second_info_same_mesh": FSDPMeshInfo(dense, shard_mesh_dim=0),
        # from dp_mesh_dims: two shard dims (FSDP2 flattens them), and a plain
        # parameters where FSDP2 wants DTensors on the SPMD mesh (every one on it)
        "spmd_two_shard_dims": _get_mesh_info(mesh, DataParallelMeshDims(shard=("a", "b"))),
        "spmd_plain_param": _get_mesh_info(mesh, DataParallelMeshDims(shard="b")),
    }
    out = {}
    for name, info in cases.items():
        torch.manual_seed(0)
        model = MoEBlock()
        w1 = model.experts.w1

        def placement(p: nn.Parameter, info=info, w1=w1, every=name == "spmd_plain_param"):
            return ShardPlacementResult(Shard(0), info) if p is w1 or every else None

        with record_collectives() as log:
            try:
                fs.fully_shard(model, mesh=dense, shard_placement_fn=placement)
                out[name] = ("no error", "", {})
            except (NotImplementedError, ValueError) as err:
                out[name] = (type(err).__name__, str(err), dict(log.counts()))
    # a plain mesh info in a call with dp_mesh_dims: FSDP2 would take the parameter (a
    # DTensor on the call's SPMD mesh) as tensor parallel beside a second dp mesh
    spmd = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    model = MoEBlock()
    _distribute_all(model, spmd)
    w1, plain = model.experts.w1, FSDPMeshInfo(dense, shard_mesh_dim=0)
    with record_collectives() as log:
        try:
            fs.fully_shard(
                model,
                mesh=spmd,
                dp_mesh_dims=DataParallelMeshDims(shard="dp"),
                shard_placement_fn=lambda p: (
                    ShardPlacementResult(Shard(0), plain) if p is w1 else None
                ),
            )
            out["plain_info_in_spmd_call"] = ("no error", "", {})
        except NotImplementedError as err:
            out["plain_info_in_spmd_call"] = (type(err).__name__, str(err), dict(log.counts()))
    return out


def test_unsupported_mesh_infos_raise_naming_the_parameter() -> None:
    for out in run_distributed(_refusals, 2):
        for name in (
            "ddp",
            "hsdp_dims_swapped",
            "fsdp_on_2d_mesh",
            "spmd_two_shard_dims",
            "plain_info_in_spmd_call",
        ):
            kind, message, counts = out[name]
            assert kind == "NotImplementedError", (name, kind, message)
            assert "'experts.w1'" in message and "ShardPlacementResult" in message, message
            assert counts == {}, (name, counts)  # raised before any collective
        assert "DDPMeshInfo" in out["ddp"][1]
        assert "shard_mesh_dim=0, replicate_mesh_dim=1" in out["hsdp_dims_swapped"][1]
        assert "several mesh dims" in out["spmd_two_shard_dims"][1]
        assert "without dp_mesh_dims in a call with" in out["plain_info_in_spmd_call"][1]
        # FSDP2's ValueError and message (its first parameter), agreed by the ranks
        kind, message, _ = out["spmd_plain_param"]
        assert kind == "ValueError", (kind, message)
        assert "Got plain tensor for parameter 'norm.weight'" in message, message
        # FSDP2's rule: the call's mesh and a second mesh info on the same process group
        kind, message, _ = out["second_info_same_mesh"]
        assert kind == "ValueError" and "same FSDPMeshInfo object" in message, message
        assert "'experts.w1'" in message


# ------------------------------------------------------------------ torchtitan
# torchtitan 0.3.0's DeepSeek-V3 debug model (8 routed experts, top-3) parallelized by
# its own parallelize_deepseekv3 with expert parallelism 2 under its full_dtensor
# backend: apply_fsdp_to_decoder's shard_placement_fn returns ShardPlacementResult with
# _get_mesh_info(edp_mesh, edp_mesh_dims) for the routed experts (the sparse mesh
# ([dp_replicate,] efsdp, ep)) and _get_mesh_info(dp_mesh, dp_mesh_dims) for the rest
# (the dense mesh ([dp_replicate,] dp_shard)). The CPU patches are those of
# flexshard.testing.torchtitan_cpu (device type, FlexAttention, PREMUL_SUM); nothing else:
# its grouped_mm runs on CPU and its token dispatch's all_to_all_single on gloo. (Its
# default spmd_types backend gives fully_shard plain tensors: torch's FSDP2 refuses them,
# and so does flexshard.)

TT_EP = 2


def _deepseek_dims(world: int, replicate: int):
    """One ParallelDims (its meshes) per process for both libraries: DTensor hands an
    equal mesh built earlier back in a new parameter's spec, FSDP2 wants the very one."""
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    if (world, replicate) not in _MESHES:
        dims = ParallelDims(
            dp_replicate=replicate,
            dp_shard=world // replicate,
            cp=1,
            tp=1,
            pp=1,
            ep=TT_EP,
            world_size=world,
            spmd_backend="full_dtensor",
        )
        dims.build_mesh()
        _MESHES[world, replicate] = dims
    dist_utils.set_spmd_backend("full_dtensor")  # as torchtitan's Trainer does
    return _MESHES[world, replicate]


def _build_deepseek(world: int, replicate: int, library: str, param_dtype: str):
    """torchtitan's DeepSeek-V3 debug model through its own parallelize_fn, with FSDP2
    or flexshard's fully_shard at torchtitan's import site, initialised from one seed."""
    from flexshard.testing.torchtitan_cpu import Run, apply_cpu_patches, parallelized

    apply_cpu_patches()
    from torchtitan.config import ParallelismConfig
    from torchtitan.models.deepseek_v3 import model_registry

    parallelism = ParallelismConfig(
        data_parallel_replicate_degree=replicate,
        data_parallel_shard_degree=world // replicate,
        expert_parallel_degree=TT_EP,
        spmd_backend="full_dtensor",
    )
    dims = _deepseek_dims(world, replicate)
    spec = model_registry("debugmodel", attn_backend="flex")
    model = parallelized(spec, dims, parallelism, library, param_dtype)
    return Run(model, dims, world)


def _deepseek_step(run, opt: torch.optim.Optimizer, inputs, labels) -> torch.Tensor:
    """torchtitan's step: its input wrapping, forward, its loss over the global token
    count, backward, its EP-aware gradient clipping, AdamW."""
    from torchtitan.distributed import full_dtensor
    from torchtitan.distributed import utils as dist_utils

    positions = torch.arange(inputs.shape[1]).expand_as(inputs).contiguous()
    extra = {"positions": positions}
    extra["attention_masks"] = run.model.get_attention_masks(positions=positions)
    inputs, labels, extra = full_dtensor.parallelize_inputs(run.dims, inputs, labels, extra)
    tokens = torch.tensor(float(labels.numel()))
    loss, _ = run.loss(run.model(inputs, **extra), labels, tokens)
    loss.backward()
    dist_utils.clip_grad_norm_(run.model.parameters(), 1.0, foreach=True, ep_enabled=True)
    opt.step()
    opt.zero_grad()
    return loss.detach().to_local()


def _deepseek_train(rank: int, world: int, replicate: int, param_dtype: str) -> dict:
    from flexshard.testing.torchtitan_cpu import batches

    out = {}
    for library in ("fsdp2", "flexshard"):
        run = _build_deepseek(world, replicate, library, param_dtype)
        params = dict(run.model.named_parameters())
        opt = torch.optim.AdamW(run.model.parameters(), lr=1e-3)
        with record_collectives() as log:
            losses = [_deepseek_step(run, opt, x, y) for x, y in batches(rank, 2)]
        out[library] = {
            "layout": _layout(run.model),
            "losses": losses,
            "counts": dict(log.counts()),
            "params": {n: p.detach().full_tensor() for n, p in params.items()},
        }
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world", "replicate", "param_dtype", "sparse_dims"),
    [
        (2, 1, "float32", ("efsdp", "ep")),  # efsdp = 1
        (4, 1, "bfloat16", ("efsdp", "ep")),  # efsdp = 2, torchtitan's default dtype
        (4, 2, "float32", ("dp_replicate", "efsdp", "ep")),  # HSDP, efsdp = 1
    ],
)
def test_torchtitan_deepseek_v3_expert_parallel_is_fsdp2(
    world: int, replicate: int, param_dtype: str, sparse_dims: tuple[str, ...]
) -> None:
    """Two steps bitwise FSDP2's (losses, full weights), the sharded DTensors placed
    alike, the collectives counted per kind equal."""
    pytest.importorskip("torchtitan")
    pytest.importorskip("triton")  # torchtitan imports it
    outs = run_distributed(_deepseek_train, world, replicate, param_dtype, timeout=1200)
    for result in outs:
        theirs, ours = result["fsdp2"], result["flexshard"]
        assert ours["layout"] == theirs["layout"]
        experts = [n for n in theirs["layout"] if "routed_experts" in n]
        assert experts and all(theirs["layout"][n][1] == sparse_dims for n in experts)
        assert all(torch.equal(a, b) for a, b in zip(theirs["losses"], ours["losses"]))
        differ = [n for n, p in theirs["params"].items() if not torch.equal(p, ours["params"][n])]
        assert differ == []
        assert ours["counts"] == theirs["counts"]
