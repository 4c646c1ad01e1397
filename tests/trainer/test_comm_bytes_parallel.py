"""The expert- and context-parallel exchanges in flexshard's ``comm_stats()`` (entries
``"ep"``, ``"cp"``: calls, bytes this rank sent and received, in ``"total"``) and the
trainer's per-step ``comm_bytes`` (``"ep"``, ``"cp"`` and ``"total"``, bytes sent)
beside flexshard's buckets, to the call and the byte, on W = 3 (cp = 3 all-gather and
ring, ep = 3); and ``parallelism.timeout_s`` reaches every bucket and exchange.

Expected bytes are computed from the shapes (and, for EP, from the routing each rank
made, recorded on the side): all-gathers and reduce-scatters send and receive
``(W - 1)`` local chunks, an all-to-all the rows bound for / coming from other ranks,
a ring message its whole block.
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import flexshard as fs
from flexshard.runtime.collectives import TrafficStats, attach_traffic
from flexshard.runtime.module import FlexShardModule, subtree_buckets
from flexshard.testing import run_distributed
from flexshard.trainer.config import ConfigError
from flexshard.trainer.parallel import expert_parallel
from flexshard.trainer.parallel.exchange import Exchange
from flexshard.trainer.train import run, setup

from ..helpers.trainer_cases import tiny_config

W = 3
STEPS = 2
BATCH, SEQ = 2, 24  # per rank; SEQ divisible by 2 * cp
DIM, HEADS, KV_HEADS, LAYERS = 40, 4, 2, 2
EXPERTS, TOP_K = 3, 2
FP32 = 4


def _config(folder: str, layout: str, **parallelism: object):
    par: dict = {"cp": W, "cp_method": layout} if layout != "ep" else {"ep": W}
    model: dict = {"n_layers": LAYERS}
    if layout == "ep":
        model["moe"] = {"num_experts": EXPERTS, "top_k": TOP_K, "first_dense_layers": 1}
    return tiny_config(
        f"{folder}/{layout}",
        model=model,
        training={"steps": STEPS, "seq_len": SEQ, "batch_size": BATCH},
        parallelism={**par, **parallelism},
    )


def _record_routing(log: list[list[int]]):
    """Wrap ExpertParallel.routed: each call's rows per expert on this rank."""
    original = expert_parallel.ExpertParallel.routed

    def routed(self, experts, flat, weights, chosen):
        log.append(torch.bincount(chosen.reshape(-1), minlength=self.num_experts).tolist())
        return original(self, experts, flat, weights, chosen)

    return original, routed


def _record_comm_stats(log: list[dict]):
    """Wrap FlexShardModule.comm_stats: what the trainer's resetting calls returned."""
    original = FlexShardModule.comm_stats

    def comm_stats(self, reset=False):
        stats = original(self, reset)
        if reset:  # a copy: the trainer pops "total" from what it gets
            log.append({name: dict(entry) for name, entry in stats.items()})
        return stats

    return original, comm_stats


def _run(cfg) -> dict:
    """The run's per-step ``comm_bytes`` and the model's ``comm_stats()`` per step."""
    log: list[dict] = []
    original, comm_stats = _record_comm_stats(log)
    FlexShardModule.comm_stats = comm_stats  # type: ignore[method-assign]
    try:
        records = run(cfg)
    finally:
        FlexShardModule.comm_stats = original  # type: ignore[method-assign]
    assert len(log) == STEPS + 1  # one module; the first call resets before step 1
    return {"comm_bytes": [r["comm_bytes"] for r in records], "stats": log[1:]}


def _cases(rank: int, world_size: int, folder: str) -> dict:
    out: dict = {}
    for layout in ("allgather", "ring"):
        out[layout] = _run(_config(folder, layout))
    log: list[list[int]] = []
    original, routed = _record_routing(log)
    expert_parallel.ExpertParallel.routed = routed  # type: ignore[method-assign]
    try:
        out["ep"] = _run(_config(folder, "ep"))
    finally:
        expert_parallel.ExpertParallel.routed = original  # type: ignore[method-assign]
    out["routing"] = log  # one entry per step (one MoE layer, one micro-batch)
    # the configured timeout reaches flexshard's buckets and the EP / CP exchanges
    job = setup(_config(folder, "ep", cp=1, timeout_s=7.5))
    seconds = set()
    for module in job.model.modules():
        for attr in ("expert_parallel", "context_parallel"):
            exchange = getattr(getattr(module, attr, None), "exchange", None)
            if isinstance(exchange, Exchange):
                seconds.add(("exchange", exchange.timeout.total_seconds()))
    seconds |= {("bucket", b.comm.timeout.total_seconds()) for b in subtree_buckets(job.model)}
    out["timeouts"] = sorted(seconds)
    # [[parallelism.buckets]] reach the model under cp too: one data-parallel path
    buckets = [
        {"patterns": ["layers.*"], "placement": "owned", "name": "blocks"},
        {"patterns": ["tok_embeddings.*", "norm.*", "output.*"], "name": "outer"},
    ]
    job = setup(_config(folder, "allgather", buckets=buckets))
    out["cp_buckets"] = [bucket.name for bucket in subtree_buckets(job.model)]
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    folder = str(tmp_path_factory.mktemp("comm_bytes"))
    return run_distributed(_cases, W, folder, timeout=400)


def _kv_block() -> int:
    """Bytes of one rank's keys (or values): [batch, seq / cp, kv heads, head dim]."""
    return BATCH * (SEQ // W) * KV_HEADS * (DIM // HEADS) * FP32


def _traffic(sent: int, received: int, **calls: int) -> dict[str, int]:
    """A comm_stats "ep" / "cp" entry: ``calls`` by collective, the rest 0."""
    kinds = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send_recv")
    entry = {kind: calls.get(kind, 0) for kind in kinds}
    return {
        "collectives": sum(entry.values()),
        **entry,
        "bytes_sent": sent,
        "bytes_received": received,
        "all_gather_bytes": 0,  # parameter all-gathers only
    }


def _check_totals(per_rank: dict, kind: str, other: str) -> None:
    """comm_stats' total adds the buckets and the exchanges; the trainer's comm_bytes
    are the entries' bytes sent, its total included."""
    for stats, sent in zip(per_rank["stats"], per_rank["comm_bytes"]):
        assert other not in stats and other not in sent
        buckets = [name for name in stats if name not in ("total", kind)]
        assert "layers.0" in buckets and len(buckets) >= 3  # the buckets stay
        for key, value in stats["total"].items():
            assert value == sum(stats[name].get(key, 0) for name in [*buckets, kind]), key
        assert sent == {name: entry["bytes_sent"] for name, entry in stats.items()}
        assert sent["total"] > sent[kind] > 0


@pytest.mark.slow
def test_allgather_cp_calls_and_bytes_per_step(results):
    # per layer: K and V all-gathered (forward), their gradients reduce-scattered
    moved = LAYERS * 2 * (W - 1) * _kv_block()  # each way, by the gathers and by the scatters
    expected = _traffic(2 * moved, 2 * moved, all_gather=2 * LAYERS, reduce_scatter=2 * LAYERS)
    for per_rank in results:
        case = per_rank["allgather"]
        assert [step["cp"] for step in case["stats"]] == [expected] * STEPS
        _check_totals(case, "cp", "ep")


@pytest.mark.slow
def test_ring_cp_calls_and_bytes_per_step(results):
    # per layer: W - 1 K/V blocks forward, W - 1 again backward and W fp32 gradient
    # accumulator blocks (each [2, batch, kv heads, seq / cp, head dim]), each message
    # one send and one receive of the same size
    messages = LAYERS * (2 * (W - 1) + W)
    moved = messages * 2 * _kv_block()
    expected = _traffic(moved, moved, send_recv=messages)
    for per_rank in results:
        case = per_rank["ring"]
        assert [step["cp"] for step in case["stats"]] == [expected] * STEPS
        _check_totals(case, "cp", "ep")


@pytest.mark.slow
def test_ep_calls_and_bytes_per_step(results):
    local = EXPERTS // W  # experts per EP rank; expert e lives on rank e // local
    for rank, per_rank in enumerate(results):
        case = per_rank["ep"]
        got = [step["ep"] for step in case["stats"]]
        expected = []
        for step in range(STEPS):
            rows = [results[r]["routing"][step] for r in range(W)]  # [rank][expert]
            mine = range(rank * local, (rank + 1) * local)
            out_rows = sum(n for e, n in enumerate(rows[rank]) if e not in mine)
            in_rows = sum(rows[r][e] for r in range(W) if r != rank for e in mine)
            # dispatch and combine forward, their gradients backward (fp32 rows of dim):
            # out_rows leave and in_rows arrive twice, in_rows leave and out_rows
            # arrive twice; and, once, the counts for / from the other ranks' experts
            moved = 2 * (out_rows + in_rows) * DIM * FP32 + (W - 1) * local * 8
            expected.append(_traffic(moved, moved, all_to_all=5))
        assert got == expected, (rank, got, expected)
        _check_totals(case, "ep", "cp")
        assert sum(results[rank]["routing"][0]) == BATCH * SEQ * TOP_K  # positive control


@pytest.mark.slow
def test_timeout_s_reaches_buckets_and_exchanges(results):
    for per_rank in results:
        assert per_rank["timeouts"] == [("bucket", 7.5), ("exchange", 7.5)]


def test_timeout_s_must_be_positive():
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="parallelism.timeout_s"):
            tiny_config("unused", parallelism={"timeout_s": bad})
    assert datetime.timedelta(seconds=tiny_config("unused").parallelism.timeout_s) == (
        datetime.timedelta(minutes=5)
    )


def _uneven_all_to_all(rank: int, world_size: int) -> dict:
    """Rank 0 sends 3 rows to rank 1 and 1 to itself; rank 1 sends none (a rank whose
    tokens all chose its own experts, or none): counted and exchanged all the same."""
    import torch.distributed as dist

    exchange = Exchange(dist.group.WORLD, "layers.9.experts", "ep")
    rows = torch.arange(4 * 5, dtype=torch.float32).view(4, 5) if rank == 0 else torch.empty(0, 5)
    send = [1, 3] if rank == 0 else [0, 0]
    recv = [1, 0] if rank == 0 else [3, 0]
    out = torch.empty(sum(recv), 5)
    exchange.all_to_all(out, rows, "EP dispatch all-to-all", recv, send)
    return {"out": out, "sent": exchange.bytes_sent}


def test_an_all_to_all_with_no_rows_is_counted_and_exchanged():
    first, second = run_distributed(_uneven_all_to_all, 2, timeout=120)
    rows = torch.arange(20, dtype=torch.float32).view(4, 5)
    assert torch.equal(first["out"], rows[:1]) and torch.equal(second["out"], rows[1:])
    assert (first["sent"], second["sent"]) == (3 * 5 * FP32, 0)


def _exchanges_on_a_model(rank: int, world_size: int) -> dict:
    """An EP exchange attached to a submodule of a flexshard model: its all-to-all,
    all-gather and ring send/recv appear in the model's comm_stats()["ep"] and total."""
    mesh = init_device_mesh("cpu", (world_size,))
    inner = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    exchange = Exchange(dist.group.WORLD, "0", "ep")
    exchange.attach(inner[0])  # before sharding, as apply_ep does
    model = fs.flex_shard(inner, mesh=mesh, buckets=[fs.BucketSpec(["0.*", "1.*"], name="all")])
    rows = torch.full((2 * world_size, 3), float(rank))  # two fp32 rows of 3 for each rank
    exchange.all_to_all(torch.empty_like(rows), rows, "EP dispatch all-to-all")
    local = torch.arange(5, dtype=torch.float32)
    exchange.all_gather(torch.empty(5 * world_size), local, "CP key all-gather")
    exchange.all_gather(torch.empty(5 * world_size), local, "state dict", counted=False)
    send, recv = torch.full((6,), float(rank)), torch.empty(6)
    to, source = (rank + 1) % world_size, (rank - 1) % world_size
    for pending in exchange.send_recv(send, recv, to, source, 0, "CP ring K/V block"):
        exchange.wait(pending)
    before = model.comm_stats(reset=True)
    after = model.comm_stats()
    clash = fs.flex_shard(
        nn.Sequential(nn.Linear(2, 2)), mesh=mesh, buckets=[fs.BucketSpec("0.*", name="ep")]
    )
    attach_traffic(clash[0], "ep", TrafficStats())
    try:
        clash.comm_stats()
        clash_error = ""
    except ValueError as err:
        clash_error = str(err)
    return {"before": before, "after": after, "recv": recv.tolist(), "clash": clash_error}


def test_exchanges_attached_to_a_model_are_in_its_comm_stats():
    for rank, out in enumerate(run_distributed(_exchanges_on_a_model, 2, timeout=120)):
        a2a, gathered, ring = 2 * 3 * FP32, 5 * FP32, 6 * FP32  # each way, for the peer
        moved = a2a + gathered + ring
        expected = _traffic(moved, moved, all_to_all=1, all_gather=1, send_recv=1)
        assert out["before"]["ep"] == expected, rank
        assert out["before"]["total"] == {
            k: v + out["before"]["all"].get(k, 0) for k, v in expected.items()
        }
        assert out["before"]["all"]["collectives"] == 0  # the bucket moved nothing
        assert out["after"]["ep"] == _traffic(0, 0) and out["after"]["total"]["bytes_sent"] == 0
        assert out["recv"] == [float(1 - rank)] * 6  # and the message arrived
        assert "bucket 'ep' has the name of the 'ep' traffic entry" in out["clash"]


def test_attach_traffic_refuses_what_it_cannot_report():
    module = nn.Linear(2, 2)
    with pytest.raises(TypeError, match="must be a TrafficStats"):
        attach_traffic(module, "ep", {"bytes_sent": 0})  # type: ignore[arg-type]
    for kind in ("", "total"):
        with pytest.raises(ValueError, match="not a usable comm_stats key"):
            attach_traffic(module, kind, TrafficStats())
    with pytest.raises(ValueError, match="must be one of"):
        TrafficStats().record("broadcast", 1, 1)


def test_configured_buckets_apply_under_cp(results):
    assert all(r["cp_buckets"] == ["blocks", "outer"] for r in results)
