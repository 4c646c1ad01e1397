"""Two flexshard models in one process, on different process groups, trained side by
side (forwards and backwards interleaved, and one joint backward) give exactly what
each gives trained alone: their hooks, prefetches and collectives do not interfere."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist

import flexshard as fs
from flexshard.testing import TinyTransformer, TransformerConfig, make_batches, run_distributed
from flexshard.testing.collectives import CollectiveLog, record_collectives

W = 3
STEPS = 3
CFG = TransformerConfig()


def _model_a(group: dist.ProcessGroup) -> TinyTransformer:
    torch.manual_seed(0)
    buckets = [
        fs.BucketSpec("layers.0.*", name="layer0"),
        fs.BucketSpec("layers.1.*", placement=fs.FlatShard(), name="layer1"),
        fs.BucketSpec(["embed.*", "norm.*", "head.*"], placement=fs.Owned(), name="outer"),
    ]
    return fs.flex_shard(TinyTransformer(CFG), mesh=group, buckets=buckets)


def _model_b(group: dist.ProcessGroup) -> TinyTransformer:
    torch.manual_seed(1)  # another init, and the same bucket names as model A
    buckets = [
        fs.BucketSpec("layers.*", placement=fs.BlockShard((4, 8)), name="layer0"),
        fs.BucketSpec(["embed.*", "norm.*", "head.*"], name="outer"),
    ]
    return fs.flex_shard(TinyTransformer(CFG), mesh=group, buckets=buckets)


def _loss(model, batches, step: int, rank: int) -> torch.Tensor:
    tokens, targets = batches[step * W + rank]
    return model.loss(tokens, targets)


def _alone(model, batches, rank: int) -> tuple[list[float], dict]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        loss = _loss(model, batches, step, rank)
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses, _as_lists(fs.full_state_dict(model))


def _as_lists(state: dict[str, torch.Tensor]) -> dict[str, list]:
    """Plain lists cross the process boundary (torch tensors would go by shared memory
    that dies with the child); float lists compare bit for bit."""
    return {key: value.tolist() for key, value in state.items()}


def _side_by_side(a, b, batches_a, batches_b, rank: int):
    opt_a = torch.optim.AdamW(a.parameters(), lr=1e-2)
    opt_b = torch.optim.AdamW(b.parameters(), lr=1e-2)
    losses_a, losses_b = [], []
    for step in range(STEPS):
        loss_a = _loss(a, batches_a, step, rank)  # A's prefetches are in flight ...
        loss_b = _loss(b, batches_b, step, rank)  # ... while B gathers on its own group
        if step == 1:  # one backward through both graphs: both end-of-backward callbacks
            (loss_a + loss_b).backward()
        else:  # B's backward first, then A's, its forward state kept across B's step
            loss_b.backward()
            loss_a.backward()
        losses_a.append(loss_a.item())
        losses_b.append(loss_b.item())
        opt_b.step()
        opt_a.step()
        opt_a.zero_grad()
        opt_b.zero_grad()
    return (losses_a, _as_lists(fs.full_state_dict(a))), (
        losses_b,
        _as_lists(fs.full_state_dict(b)),
    )


def _run(rank: int, world_size: int) -> dict:
    group_a, group_b = dist.new_group(), dist.new_group()  # both over every rank
    batches_a = make_batches(CFG, STEPS * W, batch=2, seed=5)
    batches_b = make_batches(CFG, STEPS * W, batch=2, seed=6)
    groups = {"a": group_a, "b": group_b}
    first_a, first_b = _model_a(group_a), _model_b(group_b)
    with record_collectives() as log_a:
        alone_a = _alone(first_a, batches_a, rank)
    with record_collectives() as log_b:
        alone_b = _alone(first_b, batches_b, rank)
    a, b = _model_a(group_a), _model_b(group_b)
    with record_collectives() as log:
        together_a, together_b = _side_by_side(a, b, batches_a, batches_b, rank)
    return {
        "alone": (alone_a, alone_b),
        "together": (together_a, together_b),
        "stats": [m.comm_stats() for m in (first_a, first_b, a, b)],
        "logged": {k: _per_group(v, groups) for k, v in (("a", log_a), ("b", log_b), ("ab", log))},
    }


def _per_group(log: CollectiveLog, groups: dict[str, dist.ProcessGroup]) -> dict:
    """Per group ("a", "b", or "other"), what the shared logger saw issued on it."""
    keys = {group.group_name: key for key, group in groups.items()}
    out: dict[str, Counter] = {}
    for record in log.records:
        for group, count in record.groups.items():
            out.setdefault(keys.get(group, "other"), Counter())[record.name] += count
    return {key: dict(counts) for key, counts in out.items()}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_run, W, timeout=120)


@pytest.mark.parametrize("which", [0, 1], ids=["model_a", "model_b"])
def test_side_by_side_equals_alone_bitwise(results, which):
    for per_rank in results:
        losses_alone, state_alone = per_rank["alone"][which]
        losses_together, state_together = per_rank["together"][which]
        assert losses_together == losses_alone
        assert state_alone == state_together


def test_the_models_differ_so_the_comparison_means_something(results):
    (losses_a, state_a), (losses_b, state_b) = results[0]["alone"]
    assert losses_a != losses_b
    assert state_a["embed.weight"] != state_b["embed.weight"]


def test_each_model_issues_the_collectives_it_issues_alone(results):
    """Per bucket and kind, the same counts and bytes side by side as alone."""
    for per_rank in results:
        alone_a, alone_b, together_a, together_b = per_rank["stats"]
        assert together_a == alone_a and together_b == alone_b
        assert alone_a["total"]["collectives"] > 0


def test_each_model_communicates_on_its_own_group_only(results):
    """What the shared logger saw the process groups issue (not what the models report):
    alone, each model's collectives all go to its own group; side by side, each group
    carries exactly what it carried alone."""
    for per_rank in results:
        logged = per_rank["logged"]
        assert set(logged["a"]) == {"a"} and set(logged["b"]) == {"b"}, logged
        for key in ("a", "b"):  # positive control: the logger sees the models' traffic
            seen = logged[key][key]
            assert seen.get("all_gather_single", 0) > 0, logged
            assert seen.get("reduce_scatter_single", 0) > 0, logged
        assert logged["ab"] == {"a": logged["a"]["a"], "b": logged["b"]["b"]}, logged
