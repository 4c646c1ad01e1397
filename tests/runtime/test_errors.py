"""Bad input raises a clear error naming the parameter and the bucket, on every rank,
before anything is built or communicated (but the one agreement exchange), never hanging.

All cases run in one spawn of W = 3 gloo ranks (spawning is the slow part). Per case the
child records the exception, the collectives the failing call issued, whether the ranks
still agree on the next all-reduce and whether the module was left as it was; the parent
re-raises each recorded exception inside ``pytest.raises``.
"""

from __future__ import annotations

import builtins
import copy
import datetime
import functools
import re
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import flexshard as fs
from flexshard.testing import TinyTransformer, TransformerConfig, make_batches, run_distributed
from flexshard.testing.collectives import CollectiveLog, record_collectives

from ..helpers.reference import reference_training, sharded_training

W = 3
STEPS = 2
OUTER = ("embed.*", "norm.*", "head.*")


def _buckets(layer1=None, layer0=("layers.0.*",), outer=OUTER) -> list[fs.BucketSpec]:
    return [
        fs.BucketSpec(list(layer0), name="layer0"),
        fs.BucketSpec("layers.1.*", placement=layer1 or fs.Shard(0), name="layer1"),
        fs.BucketSpec(list(outer), name="outer"),
    ]


def _only(fqn: str, bad: object, good: fs.Placement | None = None):
    """A placement callable: ``bad`` for one parameter, ``good`` (Shard(0)) for the rest."""
    return lambda f, p: bad if f == fqn else (good or fs.Shard(0))


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4, 4))
        self.scale = nn.Parameter(torch.tensor(2.0))  # 0-d


def _tied() -> TinyTransformer:
    torch.manual_seed(0)  # the same init on every rank
    model = TinyTransformer()
    model.head.weight = model.embed.weight
    return model


def _run_cases(rank: int, world_size: int) -> dict:
    with record_collectives() as calls:  # every collective, by any route
        return _cases(rank, world_size, calls)


def _cases(rank: int, world_size: int, calls: CollectiveLog) -> dict:
    mesh = init_device_mesh("cpu", (world_size,))
    out: dict = {}

    def attempt(case, model, call):
        params = [id(p) for _, p in model.named_parameters(remove_duplicate=False)]
        cls, start, error = type(model), len(calls), None
        try:
            call(model)
        except Exception as err:
            text = err.args[0] if len(err.args) == 1 else str(err)  # KeyError: unquoted
            error = (type(err).__name__, str(text))
        collectives = calls[start:]
        total = torch.ones(1)
        dist.all_reduce(total)  # a bad call that issued a collective on some ranks only
        out[case] = {  # would leave this out of step, or hung
            "error": error,
            "collectives": collectives,
            "in_step": total.item() == world_size,
            "untouched": type(model) is cls
            and params == [id(p) for _, p in model.named_parameters(remove_duplicate=False)],
        }

    def shard(buckets, on=mesh):
        return lambda model: fs.flex_shard(model, mesh=on, buckets=buckets)

    new = TinyTransformer
    # positive control: the log sees flexshard's own collectives, the set-up agreement
    # exchange and a step's gathers and reduce-scatters
    start = len(calls)
    control = fs.flex_shard(new(), mesh=mesh, buckets=_buckets())
    setup = calls[start:]
    control.loss(*make_batches(TransformerConfig(), 1, batch=2)[0]).backward()
    out["control"] = {"setup": setup, "step": calls[start + len(setup) :]}
    attempt("no_bucket", new(), shard(_buckets(outer=("embed.*", "norm.*"))))
    attempt("two_buckets", new(), shard(_buckets(outer=(*OUTER, "layers.1.up.weight"))))
    attempt("no_match", new(), shard([*_buckets(), fs.BucketSpec("layers.9.*", name="ghost")]))
    wrapped = fs.flex_shard(new(), mesh=mesh, buckets=_buckets())
    attempt("flex_shard_twice", wrapped, shard(_buckets()))
    attempt("fully_shard_twice", fs.fully_shard(new()), lambda m: fs.fully_shard(m))
    for case, block in (("block_zero", (0, 4)), ("block_negative", (4, -2)), ("block_1d", (3,))):
        attempt(case, new(), lambda m, b=block: shard([fs.BucketSpec("*", fs.BlockShard(b))])(m))
    attempt("shard_dim", new(), shard(_buckets(_only("layers.1.qkv.weight", fs.Shard(2)))))
    attempt("shard_0d", _Scaled(), shard([fs.BucketSpec("*", fs.Shard(0), name="all")]))
    bf16 = new()
    bf16.layers[1].up.to(torch.bfloat16)
    attempt("mixed_dtype", bf16, shard(_buckets()))
    split = [
        fs.BucketSpec("embed.*", name="emb"),
        fs.BucketSpec(["layers.*", "norm.*"], name="body"),
        fs.BucketSpec("head.*", name="out"),
    ]
    attempt("tie_split", _tied(), shard(split))
    attempt(
        "owned_rank",
        new(),
        shard(_buckets(_only("layers.1.down.weight", fs.Owned(rank=7), fs.Owned()))),
    )
    attempt("not_a_placement", new(), shard(_buckets(_only("layers.1.proj.weight", "shard"))))
    attempt(
        "replicate_mix",
        new(),
        shard(_buckets(lambda f, p: fs.Replicate() if p.ndim == 1 else fs.Shard(0))),
    )
    # rank 1 disagrees with the others
    attempt("inconsistent_placement", new(), shard(_buckets(fs.Owned() if rank == 1 else None)))
    merged = [fs.BucketSpec("layers.*", name="layers"), fs.BucketSpec(list(OUTER), name="outer")]
    attempt("inconsistent_count", new(), shard(merged if rank == 1 else _buckets()))
    moved = dict(layer0=("layers.0.*", "norm.*"), outer=("embed.*", "head.*"))
    attempt("inconsistent_patterns", new(), shard(_buckets(**(moved if rank == 1 else {}))))

    # arguments of the wrapped module's methods, and of the entry points
    attempt("sync_not_bool", wrapped, lambda m: m.set_requires_gradient_sync("no"))
    attempt("reshard_not_bool", wrapped, lambda m: m.set_reshard_after_forward(1))
    attempt("check_finite_not_bool", wrapped, lambda m: m.set_check_finite_grads("yes"))
    attempt("comm_stats_reset", wrapped, lambda m: m.comm_stats(reset="yes"))
    attempt("unshard_async_not_bool", wrapped, lambda m: m.unshard(async_op="later"))
    on_time = functools.partial(fs.flex_shard, mesh=mesh, buckets=_buckets())
    attempt("timeout_not_timedelta", new(), lambda m: on_time(m, timeout=5))
    attempt("timeout_not_positive", new(), lambda m: on_time(m, timeout=datetime.timedelta(0)))
    attempt("fully_shard_timeout", new(), lambda m: fs.fully_shard(m, timeout=-1.0))
    attempt("mesh_not_a_mesh", new(), shard(_buckets(), on="cpu"))
    attempt("fully_shard_list", new(), lambda m: fs.fully_shard([m.layers[0], "layers.1"]))
    attempt("fully_shard_raf_int", new(), lambda m: fs.fully_shard(m, reshard_after_forward=5))
    attempt("clip_unsharded", new(), lambda m: fs.clip_grad_norm_(m, 1.0))
    attempt("clip_max_norm_str", wrapped, lambda m: fs.clip_grad_norm_(m, "1"))
    attempt("clip_max_norm_negative", wrapped, lambda m: fs.clip_grad_norm_(m, -1.0))
    attempt("clip_norm_type_zero", wrapped, lambda m: fs.clip_grad_norm_(m, 1.0, norm_type=0))
    attempt("init_unsharded", new(), lambda m: fs.init_params(m))
    attempt("init_fn_not_callable", wrapped, lambda m: fs.init_params(m, 3))
    attempt("load_not_mapping", wrapped, lambda m: fs.load_full_state_dict(m, [1, 2]))
    attempt("load_not_tensor", wrapped, lambda m: fs.load_full_state_dict(m, {"embed.weight": 1.0}))
    attempt("load_unsharded", new(), lambda m: fs.load_full_state_dict(m, {}))
    attempt("buckets_not_specs", new(), lambda m: fs.flex_shard(m, mesh=mesh, buckets="*"))
    attempt(
        "module_not_module", new(), lambda m: fs.flex_shard("model", mesh=mesh, buckets=_buckets())
    )
    attempt("raf_not_bool", new(), lambda m: on_time(m, reshard_after_forward="yes"))
    attempt("mp_policy_str", new(), lambda m: on_time(m, mp_policy="bf16"))
    attempt("fully_shard_raf", new(), lambda m: fs.fully_shard(m, reshard_after_forward="no"))
    attempt("fully_shard_mp", new(), lambda m: fs.fully_shard(m, mp_policy=None))
    attempt("fully_shard_fn", new(), lambda m: fs.fully_shard(m, shard_placement_fn=0))
    for case, make in {
        "spec_pattern_int": lambda: fs.BucketSpec(5),
        "spec_patterns_empty": lambda: fs.BucketSpec([]),
        "spec_placement_str": lambda: fs.BucketSpec("*", placement="shard"),
        "spec_mp_policy_str": lambda: fs.BucketSpec("*", mp_policy="bf16"),
        "spec_quant_str": lambda: fs.BucketSpec("*", quant="fp8"),
        "spec_pack_not_bool": lambda: fs.BucketSpec("*", pack_as_bytes="yes"),
        "shard_dim_str": lambda: fs.Shard("0"),
        "owned_rank_str": lambda: fs.Owned(rank="a"),
    }.items():
        attempt(case, new(), lambda m, make=make: make())

    # load_full_state_dict: the bad key is the last one, so a load that checked as it
    # went would already have changed every other parameter
    before = fs.full_state_dict(wrapped)
    bumped = {k: v + 1 for k, v in before.items()}
    missing = {k: v for k, v in bumped.items() if k != "head.weight"}
    loads = {
        "load_missing_key": missing,
        "load_wrong_shape": {**missing, "head.weight": torch.zeros(17, 19)},
        "load_unexpected_key": {**bumped, "head.bias": torch.zeros(17)},
    }
    for case, sd in loads.items():
        attempt(case, wrapped, lambda m, sd=sd: fs.load_full_state_dict(m, sd))
        after = fs.full_state_dict(wrapped)
        out[case]["unchanged"] = all(torch.equal(before[k], after[k]) for k in before)

    # tied parameters in one bucket: the tie survives sharding, forward and a step
    cfg = TransformerConfig()
    batches = make_batches(cfg, STEPS * world_size, batch=2, seed=1)
    model = _tied()
    expected = reference_training(copy.deepcopy(model), batches, world_size, STEPS)
    fs.flex_shard(model, mesh=mesh, buckets=_buckets())
    ties = [model.head.weight is model.embed.weight]
    model.head.register_forward_pre_hook(
        lambda mod, _: ties.append(
            mod.weight is model.embed.weight and tuple(mod.weight.shape) == (cfg.vocab, cfg.dim)
        )
    )
    losses = sharded_training(model, rank, world_size, batches, STEPS)
    ties.append(model.head.weight is model.embed.weight)
    out["tied_one_bucket"] = {
        "ties": ties,
        "losses": losses,
        "expected": [row[rank] for row in expected],
    }

    # rank 1 alone fails a check; 0 and 2 must not wait for it in a collective (each
    # case gets a group with a 3 s timeout, so a wait that never ends raises instead)
    short = dist.new_group(timeout=datetime.timedelta(seconds=3))
    attempt(
        "rank_local_error",
        new(),
        shard(_buckets(outer=("embed.*", "norm.*") if rank == 1 else OUTER), on=short),
    )
    short = dist.new_group(timeout=datetime.timedelta(seconds=3))
    attempt("rank_local_early_error", new(), shard([] if rank == 1 else _buckets(), on=short))

    # meshes and groups that leave rank 2 out (last: they register groups on some ranks)
    sub = DeviceMesh("cpu", torch.tensor([0, 1]))
    attempt("mesh_without_rank", new(), shard(_buckets(), on=sub))
    pg01 = dist.new_group([0, 1])  # rank 2 gets the NON_GROUP_MEMBER sentinel
    attempt("group_without_rank", new(), shard(_buckets(), on=pg01))
    pg12 = dist.new_group([1, 2])
    real = dist.new_group
    dist.new_group = functools.partial(real, timeout=datetime.timedelta(seconds=3))
    try:  # bounded wait: a group rendezvous that never completes raises instead of hanging
        attempt("later_subgroup", new(), shard(_buckets(), on=pg12) if rank else lambda m: None)
    finally:
        dist.new_group = real
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_run_cases, W, timeout=60)


def _reraise(record: dict) -> None:
    if record["error"] is not None:
        name, message = record["error"]
        exc = getattr(builtins, name, None)
        raise exc(message) if exc else RuntimeError(f"{name}: {message}")


def _all_of(*needles: str) -> str:
    return "(?s)" + "".join(f"(?=.*{re.escape(n)})" for n in needles)


LAYER1 = "'layer1'"
CASES = {  # case: (exception, needles in the message, ranks that raise: None for all)
    "no_bucket": (ValueError, ("'head.weight'", "no bucket"), None),
    "two_buckets": (ValueError, ("'layers.1.up.weight'", LAYER1, "'outer'"), None),
    "no_match": (ValueError, ("'ghost'", "'layers.9.*'"), None),
    "flex_shard_twice": (ValueError, ("already sharded",), None),
    "fully_shard_twice": (ValueError, ("already sharded",), None),
    "block_zero": (ValueError, ("BlockShard", "(0, 4)"), None),
    "block_negative": (ValueError, ("BlockShard", "(4, -2)"), None),
    "block_1d": (ValueError, ("BlockShard", "(3,)"), None),
    "shard_dim": (ValueError, ("Shard(2)", "'layers.1.qkv.weight'", LAYER1), None),
    "shard_0d": (ValueError, ("Shard(0)", "'scale'", "'all'"), None),
    "mixed_dtype": (ValueError, ("'layers.1.up.weight'", "bfloat16", LAYER1), None),
    "tie_split": (ValueError, ("'embed.weight'", "'head.weight'", "'emb'", "'out'"), None),
    "owned_rank": (ValueError, ("Owned(rank=7)", "'layers.1.down.weight'", LAYER1), None),
    "not_a_placement": (TypeError, ("'layers.1.proj.weight'", LAYER1, "'shard'"), None),
    "replicate_mix": (ValueError, ("'layers.1.attn_norm.weight'", LAYER1, "Replicate"), None),
    "inconsistent_placement": (ValueError, (LAYER1, "differently"), None),
    "inconsistent_count": (ValueError, ("differ across ranks", "'outer'"), None),
    "inconsistent_patterns": (ValueError, ("'layer0'", "differently"), None),
    "load_missing_key": (KeyError, ("'head.weight'", "missing"), None),
    "load_wrong_shape": (ValueError, ("'head.weight'", "(17, 19)"), None),
    "load_unexpected_key": (KeyError, ("'head.bias'", "unexpected"), None),
    "sync_not_bool": (
        TypeError,
        ("set_requires_gradient_sync", "requires_gradient_sync", "'no'"),
        None,
    ),
    "reshard_not_bool": (
        TypeError,
        ("set_reshard_after_forward", "reshard_after_forward", "1"),
        None,
    ),
    "check_finite_not_bool": (TypeError, ("set_check_finite_grads", "'yes'"), None),
    "comm_stats_reset": (TypeError, ("comm_stats", "reset", "'yes'"), None),
    "unshard_async_not_bool": (TypeError, ("unshard", "async_op", "'later'"), None),
    "timeout_not_timedelta": (TypeError, ("timeout", "timedelta", "5"), None),
    "timeout_not_positive": (ValueError, ("timeout must be positive", "0:00:00"), None),
    "fully_shard_timeout": (TypeError, ("timeout", "timedelta", "-1.0"), None),
    "mesh_not_a_mesh": (TypeError, ("mesh", "DeviceMesh", "str"), None),
    "fully_shard_list": (TypeError, ("fully_shard", "torch.nn.Module", "str"), None),
    "fully_shard_raf_int": (ValueError, ("reshard_after_forward=5", "divisor"), None),
    "clip_unsharded": (ValueError, ("clip_grad_norm_", "sharded by flexshard"), None),
    "clip_max_norm_str": (TypeError, ("clip_grad_norm_", "max_norm", "'1'"), None),
    "clip_max_norm_negative": (ValueError, ("clip_grad_norm_", "max_norm", "-1.0"), None),
    "clip_norm_type_zero": (ValueError, ("clip_grad_norm_", "norm_type", "0"), None),
    "init_unsharded": (ValueError, ("init_params", "sharded by flexshard"), None),
    "init_fn_not_callable": (TypeError, ("init_params", "init_fn", "3"), None),
    "load_not_mapping": (TypeError, ("load_full_state_dict", "mapping", "list"), None),
    "load_not_tensor": (TypeError, ("'embed.weight'", "tensor", "float"), None),
    "load_unsharded": (ValueError, ("load_full_state_dict", "sharded by flexshard"), None),
    "buckets_not_specs": (TypeError, ("flex_shard", "buckets", "BucketSpec", "'*'"), None),
    "module_not_module": (TypeError, ("flex_shard", "module", "str"), None),
    "raf_not_bool": (TypeError, ("reshard_after_forward", "'yes'"), None),
    "mp_policy_str": (TypeError, ("mp_policy", "MixedPrecisionPolicy", "'bf16'"), None),
    "fully_shard_raf": (TypeError, ("fully_shard", "reshard_after_forward", "'no'"), None),
    "fully_shard_mp": (TypeError, ("fully_shard", "mp_policy", "None"), None),
    "fully_shard_fn": (TypeError, ("fully_shard", "shard_placement_fn", "0"), None),
    "spec_pattern_int": (TypeError, ("BucketSpec(5)", "patterns"), None),
    "spec_patterns_empty": (ValueError, ("BucketSpec([])", "patterns is empty"), None),
    "spec_placement_str": (TypeError, ("BucketSpec('*')", "placement", "'shard'"), None),
    "spec_mp_policy_str": (TypeError, ("BucketSpec('*')", "mp_policy", "'bf16'"), None),
    "spec_quant_str": (TypeError, ("BucketSpec('*')", "quant", "'fp8'"), None),
    "spec_pack_not_bool": (TypeError, ("BucketSpec('*')", "pack_as_bytes", "'yes'"), None),
    "shard_dim_str": (TypeError, ("Shard(dim)", "'0'"), None),
    "owned_rank_str": (TypeError, ("Owned(rank)", "'a'"), None),
    "mesh_without_rank": (ValueError, ("does not contain this rank (2)",), (2,)),
    "group_without_rank": (ValueError, ("does not contain this rank (2)",), (2,)),
}
NEEDS_COLLECTIVE = {"inconsistent_placement", "inconsistent_count", "inconsistent_patterns"}


def _raisers(case: str) -> range | tuple[int, ...]:
    return CASES[case][2] or range(W)


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_raises_a_clear_error(results, case):
    exc, needles, _ = CASES[case]
    for rank, per_rank in enumerate(results):
        error = per_rank[case]["error"]
        if rank not in _raisers(case):
            assert error is None, (rank, error)
            continue
        assert error is not None and error[0] == exc.__name__, (rank, error)
        with pytest.raises(exc, match=_all_of(*needles)):
            _reraise(per_rank[case])


@pytest.mark.parametrize("case", sorted(set(CASES) - NEEDS_COLLECTIVE))
def test_raised_before_anything_but_the_agreement_exchange(results, case):
    """Not zero collectives: a check that fails on one rank only must still raise on
    the others (see below), which takes one exchange. So: at most that one, the same
    on every rank, and no group creation (a rendezvous) before it."""
    logs = {tuple(results[r][case]["collectives"]) for r in _raisers(case)}
    assert len(logs) == 1, logs
    (log,) = logs
    assert len(log) <= 1 and "new_group" not in log, log


def test_ranks_stay_in_step_after_every_error(results):
    for per_rank in results:
        assert [c for c, rec in per_rank.items() if not rec.get("in_step", True)] == []


@pytest.mark.parametrize("case", sorted(set(CASES) - {"mesh_without_rank", "group_without_rank"}))
def test_failed_call_leaves_the_module_as_it_was(results, case):
    """No FlexShard class, the same parameter objects (a wrapped module stays as wrapped)."""
    assert [per_rank[case]["untouched"] for per_rank in results] == [True] * W


@pytest.mark.parametrize("case", ["load_missing_key", "load_wrong_shape", "load_unexpected_key"])
def test_failed_load_changes_no_parameter(results, case):
    assert [per_rank[case]["unchanged"] for per_rank in results] == [True] * W


@pytest.mark.parametrize("case", ["rank_local_error", "rank_local_early_error"])
def test_error_on_one_rank_raises_on_every_rank(results, case):
    errors = [per_rank[case]["error"] for per_rank in results]
    assert [e and e[0] for e in errors] == ["ValueError"] * W, errors
    for rank in (0, 2):  # the others say which rank failed
        with pytest.raises(ValueError, match=re.escape("ranks [1]")):
            _reraise(results[rank][case])


def test_error_on_one_rank_is_named_on_every_rank(results):
    for per_rank in results:
        with pytest.raises(ValueError, match=_all_of("'head.weight'", "no bucket")):
            _reraise(per_rank["rank_local_error"])


def test_tied_parameters_in_one_bucket_train_and_stay_tied(results):
    for per_rank in results:
        tied = per_rank["tied_one_bucket"]
        assert tied["ties"] == [True] * (STEPS + 2)  # after sharding, each forward, at the end
        assert tied["losses"] == pytest.approx(tied["expected"], rel=1e-5, abs=1e-6)


def test_groups_registered_on_some_ranks_do_not_hang_a_later_flex_shard(results):
    """A mesh or group leaving rank 2 out registers groups on ranks 0 and 1 only; a later
    flex_shard over ranks 1 and 2 must still find its reduce group."""
    assert [results[r]["later_subgroup"]["error"] for r in (1, 2)] == [None, None]


def test_the_log_sees_the_collectives_flexshard_issues(results):
    """Positive control for the checks above: the same log records a valid flex_shard's
    agreement exchange, a forward and backward's all-gathers and reduce-scatters (one
    per bucket) and the end-of-backward agreement on unused parameters (one all-reduce),
    and the one exchange that finds a disagreement across ranks."""
    for per_rank in results:
        control = per_rank["control"]
        assert control["setup"] == ["all_gather_single"], control
        step = Counter(control["step"])
        assert set(step) == {"all_gather_single", "reduce_scatter_single", "all_reduce"}, control
        assert step["reduce_scatter_single"] == 3 and step["all_gather_single"] >= 3, control
        assert step["all_reduce"] == 1, control
        for case in NEEDS_COLLECTIVE:
            assert per_rank[case]["collectives"] == ["all_gather_single"], case
