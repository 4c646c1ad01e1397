"""The runtime's CUDA stream protocol, checked for races on CPU: training steps run with
a simulated stream runtime (tests/helpers/stream_sim.py) in place of the CUDA one, every op
and bucket collective logged on the stream it would run on. No access may read what
another stream wrote (or overwrite what it used) before waiting for it: the all-gather
stream's copy-in after the optimizer's writes, compute's reads of gathered parameters
after the gather's event, the reduce-scatter stream's reads of gradients after compute
wrote them, the optimizer's reads of ``.grad`` after compute joined that stream; and no
freed block may be reusable by its stream while another may still use it (the
reduce-scatter input's ``record_stream``). No collective of the steps may be waited
for on the host (on NCCL that blocks the CPU). Setups: ``fully_shard`` per block with
explicit prefetches and a post-optimizer event (W = 3); ``flex_shard`` with MXFP8 tiles,
Owned, Replicate and row buckets (W = 3); HSDP (2 x 2) with blocks kept gathered after
forward and gradients accumulated over two micro-batches, the first unsynced."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import flexshard as fs
from flexshard.fsdp import clip as clip_module
from flexshard.quant import MXFP8
from flexshard.quant.compiled import set_compile_mode
from flexshard.runtime import bucket as bucket_module
from flexshard.runtime import collectives
from flexshard.testing import TinyTransformer, TransformerConfig, make_batches, run_distributed

from ..helpers.stream_sim import SimStreams, StreamAccesses

CFG = TransformerConfig(vocab=64, dim=64, heads=4, hidden=128, layers=2, seq=8)
BF16 = fs.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
#: what each bucket collective reads and writes: (reads, writes) from its arguments
COLLECTIVES = {
    "all_gather": lambda out, local, *_: ([local], [out]),
    "reduce_scatter": lambda out, full, *_: ([full], [out]),
    "all_reduce": lambda tensor, *_: ([tensor], [tensor]),
    "agree": lambda flags, *_: ([flags], [flags]),
    "gather_flags": lambda out, local, *_: ([local], [out]),
}


def _install(sim: SimStreams, mode: StreamAccesses, seen: set, blocking: list) -> None:
    bucket_module.device_runtime = lambda device, group: sim
    collectives.device_runtime = lambda device, group: sim
    clip_module.device_runtime = lambda device, group: sim
    wait = collectives.Pending.wait

    def logged_wait(self) -> None:
        if self.event is None and self.work is not None:  # the CPU would block on NCCL
            blocking.append(self.collective)
        wait(self)

    collectives.Pending.wait = logged_wait
    for kind, touched in COLLECTIVES.items():
        original = getattr(collectives.BucketComm, kind)

        def logged(self, *args, _original=original, _kind=kind, _touched=touched, **kwargs):
            seen.add(_kind)
            reads, writes = _touched(*args)
            mode.access(_kind, reads, writes)
            return _original(self, *args, **kwargs)

        setattr(collectives.BucketComm, kind, logged)


def _model(setup: str, mesh) -> torch.nn.Module:
    torch.manual_seed(0)
    model = TinyTransformer(CFG)
    if setup in ("fully_shard", "hsdp_accumulate"):
        keep = setup == "hsdp_accumulate"  # layers stay gathered from forward to backward
        for layer in model.layers:
            fs.fully_shard(layer, mesh=mesh, mp_policy=BF16, reshard_after_forward=not keep)
        if not keep:  # explicit prefetches, as torchtitan sets them
            first, second = model.layers
            first.set_modules_to_forward_prefetch([second])
            second.set_modules_to_backward_prefetch([first])
        fs.fully_shard(model, mesh=mesh, mp_policy=BF16)
        model.set_agree_on_unused_params(True)  # its all-reduce on the streams too (opt-in)
        return model
    buckets = []  # flex_shard: tiles quantized, whole matrices owned, replicated, rows
    for i in range(CFG.layers):
        mats = [f"layers.{i}.{m}.weight" for m in ("qkv", "proj", "up", "down")]
        buckets.append(
            fs.BucketSpec(mats, placement=fs.BlockShard((32, 32)), name=f"m{i}", quant=MXFP8())
        )
        rest = [f"layers.{i}.{m}.*" for m in ("attn_norm", "mlp_norm")]
        rest += [f"layers.{i}.{m}.bias" for m in ("up", "down", "proj")]
        buckets.append(fs.BucketSpec(rest, name=f"rest{i}"))
    buckets.append(fs.BucketSpec(["embed.*", "head.*"], placement=fs.Owned(), name="io"))
    buckets.append(fs.BucketSpec("norm.*", placement=fs.Replicate(), name="norm"))
    return fs.flex_shard(model, mesh=mesh, buckets=buckets, mp_policy=BF16)


def _train(rank: int, world_size: int, setup: str) -> tuple[list[str], dict, int, set, list]:
    set_compile_mode("off")  # a compiled codec would not run under the dispatch mode
    hsdp = setup == "hsdp_accumulate"
    mesh = init_device_mesh("cpu", (2, 2) if hsdp else (world_size,))
    sim = SimStreams()
    mode = StreamAccesses(sim)
    seen: set = set()  # the bucket collectives issued
    blocking: list = []  # collectives waited for on the host
    _install(sim, mode, seen, blocking)
    model = _model(setup, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    micro = 2 if hsdp else 1  # HSDP: gradients accumulated unsynced, then reduced
    batches = make_batches(CFG, 3 * micro * world_size, batch=2)
    blocking.clear()  # the one-time set-up agreement waits on the host; steps must not
    with mode:
        for step in range(3):
            for m in range(micro):
                model.set_requires_gradient_sync(m == micro - 1)
                tokens, targets = batches[(step * micro + m) * world_size + rank]
                model.loss(tokens, targets).backward()
            if step == 1:
                fs.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            if setup == "fully_shard":  # torchtitan's: the next all-gathers wait on it
                model.set_post_optim_event(sim.record())
    return sorted(set(sim.races + mode.hazards)), sim.counts, mode.ops, seen, blocking


@pytest.mark.parametrize("setup", ["fully_shard", "flex_shard", "hsdp_accumulate"])
def test_no_stream_races_in_training_steps(setup):
    world = 4 if setup == "hsdp_accumulate" else 3
    for races, counts, ops, seen, blocking in run_distributed(_train, world, setup):
        assert races == [], races[:10]
        assert blocking == []  # on CUDA nothing waits for a collective on the CPU
        assert {"all_gather", "reduce_scatter", "agree"} <= seen
        # the Replicate bucket; HSDP's all-reduce across replicas
        assert setup == "fully_shard" or "all_reduce" in seen
        assert ops > 1000 and counts["on"] > 0 and counts["join"] > 0
        assert counts["wait"] > 0  # the gathers' events were waited on
