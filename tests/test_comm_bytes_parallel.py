"""The trainer's per-step ``comm_bytes`` counts the expert- and context-parallel
exchanges (``"ep"``, ``"cp"``: bytes this rank sent in the step) beside flexshard's
buckets, to the byte, on W = 3 (cp = 3 all-gather and ring, ep = 3); and
``parallelism.timeout_s`` reaches every bucket and exchange.

Expected bytes are computed from the shapes (and, for EP, from the routing each rank
made, recorded on the side): all-gathers and reduce-scatters send ``(W - 1)`` local
chunks, an all-to-all the rows bound for other ranks, a ring send its whole block.
"""

from __future__ import annotations

import datetime

import pytest
import torch

from flexshard.runtime.module import subtree_buckets
from flexshard.testing import run_distributed
from flexshard.trainer import expert_parallel
from flexshard.trainer.config import ConfigError
from flexshard.trainer.exchange import Exchange
from flexshard.trainer.train import run, setup

from .trainer_cases import tiny_config

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


def _cases(rank: int, world_size: int, folder: str) -> dict:
    out: dict = {}
    for layout in ("allgather", "ring"):
        out[layout] = [r["comm_bytes"] for r in run(_config(folder, layout))]
    log: list[list[int]] = []
    original, routed = _record_routing(log)
    expert_parallel.ExpertParallel.routed = routed  # type: ignore[method-assign]
    try:
        out["ep"] = [r["comm_bytes"] for r in run(_config(folder, "ep"))]
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
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    folder = str(tmp_path_factory.mktemp("comm_bytes"))
    return run_distributed(_cases, W, folder, timeout=400)


def _kv_block() -> int:
    """Bytes of one rank's keys (or values): [batch, seq / cp, kv heads, head dim]."""
    return BATCH * (SEQ // W) * KV_HEADS * (DIM // HEADS) * FP32


@pytest.mark.slow
def test_allgather_cp_bytes_per_step(results):
    # per layer: K and V all-gathered (forward), their gradients reduce-scattered
    expected = LAYERS * 4 * (W - 1) * _kv_block()
    for per_rank in results:
        assert [step["cp"] for step in per_rank["allgather"]] == [expected] * STEPS
        assert "ep" not in per_rank["allgather"][0]
        assert per_rank["allgather"][0].keys() >= {"layers.0", "outer"}  # the buckets stay


@pytest.mark.slow
def test_ring_cp_bytes_per_step(results):
    # per layer: W - 1 K/V blocks forward, W - 1 again backward and W fp32 gradient
    # accumulator blocks (each [2, batch, kv heads, seq / cp, head dim])
    expected = LAYERS * (2 * (W - 1) + W) * 2 * _kv_block()
    for per_rank in results:
        assert [step["cp"] for step in per_rank["ring"]] == [expected] * STEPS


@pytest.mark.slow
def test_ep_bytes_per_step(results):
    local = EXPERTS // W  # experts per EP rank; expert e lives on rank e // local
    for rank, per_rank in enumerate(results):
        got = [step["ep"] for step in per_rank["ep"]]
        assert "cp" not in per_rank["ep"][0]
        expected = []
        for step in range(STEPS):
            rows = [results[r]["routing"][step] for r in range(W)]  # [rank][expert]
            mine = range(rank * local, (rank + 1) * local)
            out_rows = sum(n for e, n in enumerate(rows[rank]) if e not in mine)
            in_rows = sum(rows[r][e] for r in range(W) if r != rank for e in mine)
            # dispatch and combine forward, their gradients backward (fp32 rows of dim)
            # and, once, this rank's counts for the other ranks' experts (int64)
            expected.append(2 * (out_rows + in_rows) * DIM * FP32 + (W - 1) * local * 8)
        assert got == expected, (rank, got, expected)
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
