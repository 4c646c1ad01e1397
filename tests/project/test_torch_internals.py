"""One test per torch internal of flexshard.torch_internals: each fails when torch
renames the name or changes the behaviour flexshard relies on (docs/architecture.md,
"torch internals"). CPU only; worlds are torch's fake backend or one gloo rank."""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import datetime
import inspect
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import state_dict as dcp_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Placement, Shard
from torch.utils._python_dispatch import TorchDispatchMode

import flexshard.torch_internals as ti
from flexshard.plan.world import fake_world
from flexshard.testing.collectives import FUNCTIONAL_COLLECTIVES, SAME_COLLECTIVE

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed")


@contextlib.contextmanager
def gloo_world(timeout: datetime.timedelta) -> Iterator[dist.ProcessGroup]:
    """This process alone, on gloo, with ``timeout``."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    try:
        yield dist.group.WORLD  # type: ignore[misc]
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------ version gate
def test_version_gate() -> None:
    for inside in ("2.11.0", "2.13.0+cpu", "2.13.1", "2.14.1", "2.15.0+cu130"):
        assert ti.version_warning(inside) is None, inside
    for outside in ("2.10.0", "2.16.0", "3.0.0"):
        message = ti.version_warning(outside)
        assert message is not None and "2.11 to 2.15" in message and outside in message
        assert "docs/architecture.md" in message
    assert ti._WARNING == ti.version_warning(torch.__version__)


def test_single_tensor_collectives_are_torchs(monkeypatch) -> None:
    """The all-gather and reduce-scatter into (from) one tensor, under this release's name,
    looked up on torch.distributed at each call (as FSDP2 does): a patch there is seen."""
    for name, older, released in (
        ("all_gather_single", "all_gather_into_tensor", ti.ALL_GATHER_SINGLE),
        ("reduce_scatter_single", "reduce_scatter_tensor", ti.REDUCE_SCATTER_SINGLE),
    ):
        assert released == (name if hasattr(dist, name) else older)
        monkeypatch.setattr(dist, released, lambda *args, **kwargs: (args, kwargs))
        assert getattr(ti, name)(1, 2, group=3) == ((1, 2), {"group": 3})


def test_data_parallel_mesh_dims() -> None:
    """torch's class where torch has it (2.13+), else one of the same fields and checks."""
    from torch.distributed import fsdp

    if hasattr(fsdp, "DataParallelMeshDims"):
        assert ti.DataParallelMeshDims is fsdp.DataParallelMeshDims
    dims = ti.DataParallelMeshDims(shard="dp", replicate=("a", "b"))
    assert dims.shard_names == ("dp",) and dims.replicate_names == ("a", "b")
    assert ti.DataParallelMeshDims(replicate="r").shard_names == ()
    with pytest.raises(ValueError, match="At least one of shard or replicate"):
        ti.DataParallelMeshDims()


def test_gradient_reduction_handle() -> None:
    """torch's class where torch has it (2.15+), else one with the same ``wait()``: what
    FlexShardModule.finalize_backward(async_op=True) returns derives from it."""
    from torch.distributed import fsdp

    from flexshard.runtime.module import FlexGradientReductionHandle

    if hasattr(fsdp, "GradientReductionHandle"):
        assert ti.GradientReductionHandle is fsdp.GradientReductionHandle
    assert ti.GradientReductionHandle().wait() is None
    empty = FlexGradientReductionHandle(None, None)  # before the first forward
    assert isinstance(empty, ti.GradientReductionHandle) and empty.wait() is None


def test_shard_placement_result_and_mesh_infos() -> None:
    """FSDP2's per-parameter mesh result where torch has it (2.13+), None before; read as
    flexshard's PlacementMesh: the placement, the mesh, which dims shard and replicate."""
    from torch.distributed.fsdp._fully_shard import _fsdp_common

    assert ti.placement_mesh(Shard(0)) is None and ti.placement_mesh(None) is None
    if not hasattr(_fsdp_common, "ShardPlacementResult"):
        assert ti.ShardPlacementResult is None
        return
    assert ti.ShardPlacementResult is _fsdp_common.ShardPlacementResult
    assert ti.FSDPMeshInfo is _fsdp_common.FSDPMeshInfo
    assert ti.HSDPMeshInfo is _fsdp_common.HSDPMeshInfo
    with fake_world(4, rank=1):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
        hsdp = ti.HSDPMeshInfo(mesh, shard_mesh_dim=1, replicate_mesh_dim=0)
        read = ti.placement_mesh(ti.ShardPlacementResult(placement=Shard(1), mesh_info=hsdp))
        assert read is not None and read.placement == Shard(1) and read.mesh is mesh
        assert (read.kind, read.known, read.hsdp, read.spmd) == ("HSDPMeshInfo", True, True, False)
        assert (read.shard_dim, read.replicate_dim) == (1, 0) and read.info is hsdp
        ep = mesh["ep"]
        fsdp = ti.FSDPMeshInfo(ep, shard_mesh_dim=0)
        read = ti.placement_mesh(ti.ShardPlacementResult(placement=None, mesh_info=fsdp))
        assert read is not None and read.placement is None and read.mesh is ep
        assert (read.kind, read.known, read.hsdp) == ("FSDPMeshInfo", True, False)
        assert (read.shard_dim, read.replicate_dim) == (0, None)
        ddp = _fsdp_common.DDPMeshInfo(mesh["dp"], replicate_mesh_dim=0)
        read = ti.placement_mesh(ti.ShardPlacementResult(placement=None, mesh_info=ddp))
        assert read is not None and not read.known and read.kind == "DDPMeshInfo"


# ------------------------------------------------------------------ DTensor
def test_dtensor_spec_local_tensor_and_set_local_tensor() -> None:
    with fake_world(4, rank=1):
        mesh = init_device_mesh("cpu", (4,))
        meta = ti.TensorMeta(torch.Size((8, 3)), (3, 1), torch.float32)
        spec = ti.DTensorSpec(mesh, (Shard(0),), tensor_meta=meta)
        local = torch.arange(6.0).view(2, 3)
        dt = DTensor(local, spec, requires_grad=False)  # what region_dtensor.wrap builds
        assert ti.dtensor_spec(dt) is spec and ti.local_tensor(dt) is local
        assert dt.shape == (8, 3) and dt.placements == (Shard(0),)
        view = torch.zeros(6).view(2, 3)
        ti.set_local_tensor(dt, view)
        assert ti.local_tensor(dt) is view and dt.to_local().data_ptr() == view.data_ptr()


def test_compute_local_shape_and_global_offset() -> None:
    with fake_world(4, rank=1):
        mesh = init_device_mesh("cpu", (4,))
        shape, offset = ti.compute_local_shape_and_global_offset((8, 3), mesh, (Shard(0),))
        assert tuple(shape) == (2, 3) and tuple(offset) == (2, 0)


def test_strided_shard() -> None:
    p = ti.StridedShard(0, split_factor=2)
    assert isinstance(p, Placement) and p.dim == 0 and p.split_factor == 2
    assert p == ti.StridedShard(0, split_factor=2) and p != Shard(0)


def test_norm_partial() -> None:
    p = ti.NormPartial(2.0)
    assert p.is_partial() and p.norm_type == 2.0
    assert ti.NormPartial(2.0) == p


def test_clear_sharding_prop_cache() -> None:
    from torch.distributed.tensor import debug

    assert callable(debug._clear_sharding_prop_cache)
    ti.clear_sharding_prop_cache()


# ------------------------------------------------------------------ DeviceMesh
def test_concatenate_meshes() -> None:
    with fake_world(4, rank=3):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        joined = ti.concatenate_meshes([mesh["dp"], mesh["tp"]])
        assert joined.mesh_dim_names == ("dp", "tp") and tuple(joined.shape) == (2, 2)
        assert joined.mesh.tolist() == [[0, 1], [2, 3]] and list(joined.get_coordinate()) == [1, 1]


# ------------------------------------------------------------------ FSDP2 / composable
def test_fully_shard_state_key() -> None:
    module = nn.Linear(2, 2)
    sentinel = object()
    # where runtime/module.py registers flexshard's state for torch.distributed.pipelining
    module.__dict__.setdefault(ti.STATE_KEY, {})[ti.fully_shard_state_key()] = sentinel
    assert fully_shard.state(module) is sentinel


def test_apply_to_tensors_reaches_dataclasses() -> None:
    @dataclasses.dataclass
    class Batch:
        x: torch.Tensor
        n: int

    out = ti.apply_to_tensors(lambda t: t * 2, {"a": [torch.ones(1)], "b": Batch(torch.ones(1), 3)})
    assert out["a"][0].item() == 2 and out["b"].x.item() == 2 and out["b"].n == 3


def test_grad_reduce_dtype_is_fsdp2s() -> None:
    """The dtype torch's own FSDP2 allocates its reduce-scatter buffers in, with
    ``reduce_dtype`` unset and set (one gloo rank: FSDP2 still allocates them)."""
    unset = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    explicit = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float16)
    with gloo_world(datetime.timedelta(seconds=30)):
        mesh = init_device_mesh("cpu", (1,))
        for policy in (unset, explicit):
            model = nn.Linear(4, 4)
            fully_shard(model, mesh=mesh, mp_policy=policy)
            model(torch.ones(2, 4)).sum().backward()  # lazy init builds the group's comm
            comm = ti.fsdp_param_group(model)._reduce_scatter_comm
            allocate, dtypes = comm.allocate, []

            def recording(*args, dtype, allocate=allocate, dtypes=dtypes, **kwargs):
                dtypes.append(dtype)
                return allocate(*args, dtype=dtype, **kwargs)

            comm.allocate = recording
            model(torch.ones(2, 4)).sum().backward()
            assert dtypes and set(dtypes) == {ti.grad_reduce_dtype(policy, torch.float32)}
    assert ti.grad_reduce_dtype(explicit, torch.float32) == torch.float16


def test_follows_grad_dtype_is_fsdp2s() -> None:
    """FOLLOWS_GRAD_DTYPE says whether torch's own FSDP2 keeps a bf16-computed
    parameter's no-sync gradient in fp32 (its original dtype) or in bf16."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    with gloo_world(datetime.timedelta(seconds=30)):
        mesh = init_device_mesh("cpu", (1,))
        model = nn.Linear(4, 4)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        model.set_requires_gradient_sync(False)
        model(torch.ones(2, 4)).sum().backward()
        held = ti.fsdp_param_group(model).fsdp_params[0].unsharded_param.grad
        assert held.dtype == (torch.float32 if ti.FOLLOWS_GRAD_DTYPE else torch.bfloat16)


def test_grad_dtype_override() -> None:
    """A ``grad_dtype`` set on a parameter, None included, told apart from the default
    where torch's FSDP2 reads it (torch 2.15; before, torch cannot tell them apart)."""
    param = nn.Parameter(torch.zeros(2))
    assert ti.grad_dtype_override(param) == (False, None)
    if not ti.FOLLOWS_GRAD_DTYPE:
        return
    param.grad_dtype = None
    assert ti.grad_dtype_override(param) == (True, None)
    param.grad_dtype = torch.bfloat16
    assert ti.grad_dtype_override(param) == (True, torch.bfloat16)


def test_resolved_param_dtype() -> None:
    """FSDP2's own resolution of ``param_dtype_override_fn``, its refusal included."""
    plain = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    param = nn.Parameter(torch.zeros(2))
    assert ti.resolved_param_dtype(plain, param) == torch.bfloat16
    has = "param_dtype_override_fn" in {f.name for f in dataclasses.fields(MixedPrecisionPolicy)}
    assert ti.HAS_PARAM_DTYPE_OVERRIDE == has
    if not has:
        return
    keep = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, param_dtype_override_fn=lambda p: p.dtype
    )
    assert ti.resolved_param_dtype(keep, param) == torch.float32
    bad = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, param_dtype_override_fn=lambda p: torch.float16
    )
    with pytest.raises(ValueError, match="param_dtype_override_fn"):
        ti.resolved_param_dtype(bad, param)


# ------------------------------------------------------------------ autograd
def test_set_versions_undoes_version_bumps() -> None:
    t, u = torch.zeros(3), torch.zeros(2)
    versions = ti.versions_of((t, u))
    t.add_(1)
    u.add_(1)
    assert ti.versions_of((t, u)) != versions
    ti.set_versions((t, u), versions)
    assert ti.versions_of((t, u)) == versions and t.tolist() == [1.0, 1.0, 1.0]


def test_set_grad_mode() -> None:
    assert torch.is_grad_enabled()
    ti.set_grad_mode(False)
    try:
        assert not torch.is_grad_enabled()
    finally:
        ti.set_grad_mode(True)
    assert torch.is_grad_enabled()


def test_profiler_enabled() -> None:
    assert not ti.profiler_enabled()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert ti.profiler_enabled()
    assert not ti.profiler_enabled()


def test_queue_backward_callback_runs_after_backward() -> None:
    x = torch.ones(2, requires_grad=True)
    seen: list[torch.Tensor | None] = []

    def hook(grad: torch.Tensor) -> torch.Tensor:
        ti.queue_backward_callback(lambda: seen.append(x.grad))
        return grad

    y = x * 3
    y.register_hook(hook)
    y.sum().backward()
    assert len(seen) == 1 and seen[0] is not None and seen[0].tolist() == [3.0, 3.0]


def test_in_autograd_backward() -> None:
    x = torch.ones(2, requires_grad=True)
    seen: list[bool] = []

    def hook(grad: torch.Tensor) -> torch.Tensor:
        seen.append(ti.in_autograd_backward())
        return grad

    y = x * 3
    y.register_hook(hook)
    assert not ti.in_autograd_backward()
    y.sum().backward()
    assert seen == [True] and not ti.in_autograd_backward()


def test_post_accumulate_grad_hooks() -> None:
    p = torch.zeros(2, requires_grad=True)
    assert not ti.post_accumulate_grad_hooks(p)
    calls: list[torch.Tensor] = []
    p.register_post_accumulate_grad_hook(calls.append)
    hooks = ti.post_accumulate_grad_hooks(p)
    assert hooks is not None and len(hooks) == 1
    for hook in hooks.values():  # as reduce.py runs them
        hook(p)
    assert calls == [p]


def test_dynamo_disable() -> None:
    import torch._dynamo

    params = inspect.signature(torch._dynamo.disable).parameters
    assert "recursive" in params and "reason" in params
    wrapped = ti.dynamo_disable(lambda v: v + 1, reason="test")
    assert wrapped(1) == 2


def test_storage_id() -> None:
    base = torch.zeros(8)
    other = torch.zeros(8)
    sid = ti.storage_id(base)
    assert ti.storage_id(base[2:]) == sid and ti.storage_id(other) != sid
    base.untyped_storage().resize_(0)  # a freed bucket buffer keeps its identity
    assert ti.storage_id(base) == sid


def test_pytree() -> None:
    leaves, spec = ti.tree_flatten(((torch.ones(1), 2), {"k": torch.zeros(1)}))
    assert len(leaves) == 3 and spec.num_leaves == 3
    doubled = ti.tree_map(lambda v: v * 2, [1, (2,)])
    assert doubled == [2, (4,)]
    only = ti.tree_map_only(torch.Tensor, lambda t: t + 1, [torch.zeros(1), "s"])
    assert only[0].item() == 1 and only[1] == "s"
    assert ti.tree_leaves(((1, [2]), {"k": 3}, None)) == [1, 2, 3, None]


def test_disable_current_modes() -> None:
    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.calls += 1
            return func(*args, **(kwargs or {}))

    with Count():
        torch.ones(1) + 1
        before = Count.calls
        with ti.disable_current_modes():
            torch.ones(1) + 1
        assert Count.calls == before
    assert before > 0


def test_functional_collective_ops() -> None:
    ops = ti.functional_collective_ops()
    for name in (
        "all_gather_into_tensor",
        "reduce_scatter_tensor",
        "all_reduce",
        "all_to_all_single",
    ):
        assert isinstance(getattr(ops, name).default, torch._ops.OpOverload)


# ------------------------------------------------------------------ optimizer
def test_global_optimizer_step_post_hook() -> None:
    count = [0]
    handle = ti.register_global_optimizer_step_post_hook(
        lambda *_: count.__setitem__(0, count[0] + 1)
    )
    try:
        p = nn.Parameter(torch.ones(1))
        p.grad = torch.ones(1)
        torch.optim.SGD([p], lr=0.1).step()
        torch.optim.Adam([p]).step()  # every optimizer of the process
    finally:
        handle.remove()
    assert count[0] == 2


class _Recording(torch.optim.SGD):
    calls: list[str | None] = []

    def state_dict(self):  # type: ignore[override]
        _Recording.calls.append(ti.full_state_dict_call())
        return super().state_dict()


def test_full_state_dict_call() -> None:
    params = inspect.signature(dcp_state_dict._get_optim_state_dict).parameters
    assert "info" in params and callable(dcp_state_dict._load_optim_state_dict)
    with gloo_world(datetime.timedelta(seconds=30)):
        model = nn.Linear(2, 2)
        opt = _Recording(model.parameters(), lr=0.1, momentum=0.9)
        model(torch.ones(1, 2)).sum().backward()
        opt.step()  # state to gather (torch's full path needs a tensor in it)
        _Recording.calls.clear()
        assert ti.full_state_dict_call() is None
        dcp_state_dict.get_optimizer_state_dict(model, opt)
        full = dcp_state_dict.StateDictOptions(full_state_dict=True)
        saved = dcp_state_dict.get_optimizer_state_dict(model, opt, options=full)
        assert _Recording.calls == [None, "get"]
        _Recording.calls.clear()
        dcp_state_dict.set_optimizer_state_dict(model, opt, saved, options=full)
        assert "load" in _Recording.calls


# ------------------------------------------------------------------ state dict / DCP
def test_distribute_tensors_signature() -> None:
    from torch.distributed import _state_dict_utils as utils

    # read the source: the live function may already be flexshard's wrapper
    tree = ast.parse(inspect.getsource(utils))
    fn = next(
        n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_distribute_tensors"
    )
    assert [a.arg for a in fn.args.args] == ["local_state_dict", "keys", "device", "pg"]
    # the other name it replaces: _distribute_state_dict (broadcast_from_rank0=False)
    # cuts each whole tensor with the module-level distribute_tensor
    other = next(
        n
        for n in tree.body
        if isinstance(n, ast.FunctionDef) and n.name == "_distribute_state_dict"
    )
    called = {
        n.func.id
        for n in ast.walk(other)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
    }
    assert "distribute_tensor" in called and callable(utils.distribute_tensor)


def test_hf_safetensors_helpers() -> None:
    assert ti.hf_file_name(1, 3) == "model-00001-of-00003.safetensors"
    assert ti.hf_file_name(2, 3, 4).startswith("shard-00004-model-00002-of-00003")
    every = inspect.signature(ti.consolidate_safetensors_files_on_every_rank).parameters
    assert list(every)[:5] == [
        "input_dir", "output_dir", "fqn_to_index_mapping", "num_threads", "process_group",
    ]  # fmt: skip
    assert list(inspect.signature(ti.consolidate_safetensors_files).parameters)[:3] == [
        "input_dir", "output_dir", "fqn_to_index_mapping",
    ]  # fmt: skip


def test_drop_cached_save_plans() -> None:
    from torch.distributed.checkpoint.planner import SavePlanner

    names = ("save_plan", "all_plans", "global_plan", "metadata", "final_save_plan")
    caches = [getattr(SavePlanner, f"_cached_{n}") for n in names]
    for cache in caches:
        cache["flexshard-test"] = object()
    ti.drop_cached_save_plans("flexshard-test")
    assert all("flexshard-test" not in cache for cache in caches)


# ------------------------------------------------------------------ planner (flexshard.plan)
def test_fake_tensor_mode() -> None:
    with ti.FakeTensorMode():
        huge = torch.empty(1 << 40, dtype=torch.uint8)  # a TiB: shapes only, no storage
        out = huge.view(1 << 20, 1 << 20).float().sum(0)
    assert type(huge).__name__ == "FakeTensor" and out.shape == (1 << 20,)


def test_torch_dispatch_mode() -> None:
    class Seen(ti.TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.overloadpacket)  # what the op counter keys on
            return func(*args, **(kwargs or {}))

    with Seen() as seen:
        torch.ones(2, 2) @ torch.ones(2, 2)
    assert torch.ops.aten.mm in seen.ops


def test_fake_store() -> None:
    dist.init_process_group("fake", store=ti.FakeStore(), rank=3, world_size=8)
    try:
        assert dist.get_rank() == 3 and dist.get_world_size() == 8
        dist.all_reduce(torch.ones(1))  # a no-op, with no other rank
    finally:
        dist.destroy_process_group()


def test_mem_tracker_snapshots() -> None:
    """What activations.py reads: the saved activations after forward and backward's
    temporaries at its peak, per device, under the fake mode."""
    with ti.FakeTensorMode():
        net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
        tracker = ti.MemTracker()
        tracker.track_external(net)
        with tracker:
            net(torch.randn(32, 64)).sum().backward()
    stats = tracker.memory_tracking[net].snapshots
    (device,) = stats[ti.ModState.POST_FW][-1].keys()
    assert stats[ti.ModState.POST_FW][-1][device][ti.MemRefType.ACT] >= 2 * 32 * 64 * 4
    assert ti.MemRefType.TEMP in stats[ti.ModState.PEAK_BW][-1][device]


def test_ignore_ops() -> None:
    aten = torch.ops.aten
    # views and random / index creations: no bytes of the op counter's
    assert {aten.view, aten.t, aten.expand, aten.randn, aten.randint} <= set(ti.IGNORE_OPS)
    assert aten.add not in ti.IGNORE_OPS and aten.copy_ not in ti.IGNORE_OPS


def test_get_num_bytes() -> None:
    assert ti.get_num_bytes(torch.ones(4, 3)) == 48
    assert ti.get_num_bytes(torch.ones(4, 1).expand(4, 3)) == 16  # a broadcast reads once


def test_heavy_items_load_on_first_use() -> None:
    """``import flexshard`` leaves torch's mem_tracker and runtime estimation unloaded
    (seconds of imports); reading an item loads it."""
    code = (
        "import sys, flexshard, flexshard.torch_internals as ti\n"
        "heavy = ('torch.distributed._tools.mem_tracker', 'torch.utils._runtime_estimation')\n"
        "assert not any(m in sys.modules for m in heavy), [m for m in heavy if m in sys.modules]\n"
        "assert ti.MemTracker.__module__ == heavy[0] and heavy[1] in ti.get_num_bytes.__module__\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ------------------------------------------------------------------ process groups
def test_gloo_timeout_and_group_options() -> None:
    seconds = datetime.timedelta(seconds=77)
    with gloo_world(seconds) as world:
        assert ti.gloo_timeout(world) == seconds
        assert ti.backend_group_options("fake", seconds) is None
        five = datetime.timedelta(seconds=5)
        options = ti.backend_group_options("gloo", five)
        assert isinstance(options, dist.ProcessGroupGloo._Options) and options._timeout == five
        # as the trainer passes them: one (backend, options) per mesh dim
        mesh = init_device_mesh("cpu", (1,), backend_override={0: (None, options)})
        assert ti.gloo_timeout(mesh.get_group()) == five
        backend = world._get_backend(torch.device("cpu"))
        assert callable(backend.abort)  # what abort_cuda_backend calls on NCCL's


def test_fsdp_param_group() -> None:
    with fake_world(2, rank=1):
        mesh = init_device_mesh("cpu", (2,))
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4, bias=False))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        inner, root = ti.fsdp_param_group(model[0]), ti.fsdp_param_group(model)
        assert len(inner.fsdp_params) == 2 and len(root.fsdp_params) == 1
        assert ti.fsdp_param_group(model[1]) is None  # not a fully_shard module


def test_process_groups_and_sequence_number() -> None:
    with gloo_world(datetime.timedelta(seconds=30)) as world:
        assert world in ti.process_groups()
        before = ti.sequence_number(world)
        dist.all_reduce(torch.ones(1))
        assert ti.sequence_number(world) == before + 1


def test_functional_collectives_module() -> None:
    funcol = ti.functional_collectives_module()
    assert funcol.__name__ == "torch.distributed._functional_collectives"
    # the *_single names are 2.13's; before, the same collectives had the older names only
    older = {new: old for old, new in SAME_COLLECTIVE.items()}
    missing = [
        n
        for n in FUNCTIONAL_COLLECTIVES
        if not callable(getattr(funcol, n, None))
        and not callable(getattr(funcol, older.get(n, n), None))
    ]
    assert not missing


def test_ensure_own_dispatch_reaches_a_dtensor_subclass() -> None:
    """A DTensor subclass's own __torch_dispatch__ sees its ops from Python calls, on every
    release (torch 2.11's fast path skips it unless routed), and the probe moves nothing."""
    seen: list[str] = []

    class Logged(DTensor):
        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
            seen.append(func.overloadpacket.__name__)
            first = ti.tree_leaves(args)[0]
            local = ti.tree_map_only(DTensor, ti.local_tensor, args)
            out = func(*local, **(kwargs or {}))
            if isinstance(out, torch.Tensor):
                return cls(out, ti.dtensor_spec(first), requires_grad=False)
            return out

    with gloo_world(datetime.timedelta(seconds=30)):
        mesh = init_device_mesh("cpu", (1,))
        plain = DTensor.from_local(torch.arange(3.0), mesh, [Shard(0)])
        issued = ti.sequence_number(dist.group.WORLD)
        ti.ensure_own_dispatch(Logged, ti.dtensor_spec(plain))
        assert ti.sequence_number(dist.group.WORLD) == issued
        tensor = Logged(torch.arange(3.0), ti.dtensor_spec(plain), requires_grad=False)
        detached, doubled = tensor.detach(), tensor * 2
        param = nn.Parameter(tensor)  # nn.Parameter needs detach to keep the type
        torch._foreach_add_([tensor], [tensor])
    assert type(detached) is Logged and type(doubled) is Logged and type(param) is Logged
    assert doubled._local_tensor.tolist() == [0.0, 2.0, 4.0]
    assert tensor._local_tensor.tolist() == [0.0, 2.0, 4.0]
    assert {"detach", "mul", "_foreach_add_"} <= set(seen), seen


def test_dcp_metadata_names_and_helpers(tmp_path) -> None:
    """The private names a DCP ``.metadata`` pickle holds are these items' (the safe
    reader allows exactly them), the file the reader opens, and set_element placing a
    value in a nested state dict."""
    import pickletools

    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(2), "n": {"k": 1}}, checkpoint_id=str(tmp_path), no_dist=True)
    data = (tmp_path / ".metadata").read_bytes()
    strings = [arg for _, arg, _ in pickletools.genops(data) if isinstance(arg, str)]
    for item in (ti.DCPStorageInfo, ti.DCPMemoryFormat, ti.layout_by_name):
        assert item.__module__ in strings and item.__qualname__ in strings, item
    assert ti.layout_by_name("torch.strided") is torch.strided
    assert ti.DCPMemoryFormat.__members__  # an enum of memory formats
    reader = dcp.FileSystemReader(str(tmp_path))
    assert str(ti.dcp_metadata_file(reader, None)) == str(tmp_path / ".metadata")
    assert str(ti.dcp_metadata_file(reader, 1)) == str(tmp_path / "__1.metadata")
    state: dict = {"a": {"b": [0, 0]}}
    ti.set_nested(state, ("a", "b", 1), 5)
    assert state == {"a": {"b": [0, 5]}}
