"""accelerate's and Lightning's own training loops (flexshard/testing/client_loops.py)
with flexshard's ``fully_shard`` where the user's code imports it: bitwise FSDP2's losses
and weights, and per step no collective of any kind more than FSDP2 issues. accelerate:
its FSDP2 plugin, ``accumulate`` (gradient sync off on the first micro-batch), clipping,
an LR schedule. Lightning: ``Trainer.fit`` with ``ModelParallelStrategy``, ``fully_shard``
in ``configure_model``, its accumulation and clipping."""

from __future__ import annotations

import pytest
import torch

from flexshard.testing import run_distributed
from flexshard.testing.client_loops import LIBRARIES, LoopSetup, accelerator, build_loop

pytest.importorskip("transformers")
STEPS = 3


def _train(rank: int, world_size: int, setup: LoopSetup) -> dict:
    import flexshard

    acc = accelerator(rank, world_size, setup) if setup.client == "accelerate" else None
    out = {}
    for library in LIBRARIES:
        loop = build_loop(rank, world_size, setup, library, STEPS, acc)
        records = loop.run(STEPS, count=True)
        out[library] = {
            "losses": [r.loss for r in records],
            "counts": [r.by_kind() for r in records],
            "weights": loop.full_weights(),
        }
        if library == "flexshard":
            # accelerate shards every block, the embedding and the tail first: its root
            # fully_shard finds no parameter of its own
            roots = len(loop.model._flexshard_buckets)
            assert isinstance(loop.model, flexshard.FlexShardModule)
            out["root_buckets"] = roots
    return out


@pytest.mark.parametrize(
    ("setup", "world_size"),
    [
        (LoopSetup("accelerate", bf16=True, accumulation=2), 2),
        (LoopSetup("lightning"), 3),
        (LoopSetup("lightning", bf16=True, accumulation=2), 2),
    ],
    ids=lambda v: (
        v.label().replace(", ", "-").replace(" ", "") if isinstance(v, LoopSetup) else f"W{v}"
    ),
)
def test_client_loop_is_fsdp2(setup: LoopSetup, world_size: int) -> None:
    pytest.importorskip(setup.client)
    for result in run_distributed(_train, world_size, setup, timeout=300):
        torch_run, flex = result["fsdp2"], result["flexshard"]
        assert len(torch_run["losses"]) == STEPS
        assert all(len(step) == setup.accumulation for step in torch_run["losses"])
        assert flex["losses"] == torch_run["losses"]
        assert torch_run["weights"].keys() == flex["weights"].keys()
        mine = flex["weights"]
        assert [n for n, p in torch_run["weights"].items() if not torch.equal(p, mine[n])] == []
        # the steps trained: FSDP2's weights moved from the initial ones
        from flexshard.testing.client_loops import llama

        start = dict(llama(setup.size).named_parameters())
        assert all(not torch.equal(start[n], p) for n, p in torch_run["weights"].items())
        for theirs, ours in zip(torch_run["counts"], flex["counts"]):
            assert theirs["reduce_scatter"] > 0
            assert all(ours.get(k, 0) <= n for k, n in theirs.items()), (ours, theirs)
            assert set(ours) <= set(theirs)
        if setup.client == "accelerate":
            assert result["root_buckets"] == 0
