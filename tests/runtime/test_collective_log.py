"""The shared collective logger (flexshard.testing.collectives) sees every route a
collective can take, names each once, and its guard fails on any of them."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.distributed_c10d as c10d
from torch.distributed import all_reduce as bound_by_name  # a module-level binding
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from flexshard.testing import run_distributed
from flexshard.testing.collectives import (
    CollectiveForbidden,
    forbid_collectives,
    record_collectives,
)
from flexshard.torch_internals import all_gather_single, reduce_scatter_single

W = 2


def _routes(rank: int, world_size: int) -> dict:
    local_name = dist.all_reduce
    t = torch.ones(4)
    out: dict = {}
    mesh = init_device_mesh("cpu", (world_size,))
    sharded = distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)])
    with record_collectives() as log:
        dist.all_reduce(t)
        c10d.all_reduce(t)
        bound_by_name(t)
        local_name(t)  # bound before the log opened, in a local variable: no name
        all_gather_single(torch.empty(4 * world_size), t)
        reduce_scatter_single(torch.empty(4 // world_size), t)
        dist.all_to_all_single(torch.empty(4), t)
        # the same two under their older names: logged under the names above
        dist.all_gather_into_tensor(torch.empty(4 * world_size), t)
        dist.reduce_scatter_tensor(torch.empty(4 // world_size), t)
        dist.broadcast(t, 0)
        dist.barrier()
        dist.all_gather_object([None] * world_size, rank)  # two all_gathers inside: one entry
        peer = 1 - rank
        for work in (dist.isend(t, peer), dist.irecv(torch.empty(4), peer)):
            work.wait()
        funcol.all_gather_tensor(t, 0, dist.group.WORLD).wait()  # every release has this name
        sharded.redistribute(mesh, [Replicate()]).to_local()  # DTensor: funcol inside
        dist.group.WORLD.allreduce([t]).wait()  # a direct ProcessGroup call: no name
        group = dist.new_group()
        dist.all_reduce(t, group=group)
        out["names"] = log.names()
        out["on_group"] = log.on(group)
        out["issued"] = log.issued()
    dist.all_reduce(t)  # after the log closed: not in it
    out["after_close"] = log.names()
    out["restored"] = dist.all_reduce is local_name and bound_by_name is local_name
    # the guard: a named collective raises, even when the caller swallows the error
    for attempt in (
        lambda: all_gather_single(torch.empty(4 * world_size), t),
        lambda: funcol.all_reduce(t, "sum", dist.group.WORLD),
    ):
        try:
            with forbid_collectives():
                try:
                    attempt()
                except CollectiveForbidden:
                    pass  # swallowed, as a library might
            out.setdefault("guard", []).append(None)
        except CollectiveForbidden as err:
            out.setdefault("guard", []).append(str(err))
    # ... and a collective no wrapper sees fails it on the way out
    try:
        with forbid_collectives():
            dist.group.WORLD.allreduce([t]).wait()
        out["backstop"] = None
    except CollectiveForbidden as err:
        out["backstop"] = str(err)
    with forbid_collectives() as quiet:  # nothing issued: passes
        torch.ones(3).sum()
    out["quiet"] = quiet.names()
    return out


@pytest.fixture(scope="module")
def routes() -> list[dict]:
    return run_distributed(_routes, W, timeout=120)


def test_every_route_is_logged_once_by_name(routes):
    for got in routes:
        assert got["names"] == [
            "all_reduce",
            "all_reduce",
            "all_reduce",
            "unnamed",
            "all_gather_single",
            "reduce_scatter_single",
            "all_to_all_single",
            "all_gather_single",  # all_gather_into_tensor: the same collective
            "reduce_scatter_single",  # reduce_scatter_tensor
            "broadcast",
            "barrier",
            "all_gather_object",
            "isend",
            "irecv",
            "funcol.all_gather_single",
            "funcol.all_gather_single",  # DTensor's redistribution
            "unnamed",
            "new_group",
            "all_reduce",
        ], got["names"]
        assert got["on_group"] == ["all_reduce"]
        assert got["after_close"] == got["names"]
        # what the backend issued: all_gather_object takes 2, new_group none
        assert got["issued"] == len(got["names"])
        assert got["restored"]


def test_the_guard_fails_on_any_collective(routes):
    for got in routes:
        assert got["guard"][0] is not None and "all_gather_single" in got["guard"][0]
        assert got["guard"][1] is not None and "funcol.all_reduce" in got["guard"][1]
        assert got["backstop"] is not None and "unnamed" in got["backstop"]
        assert got["quiet"] == []
