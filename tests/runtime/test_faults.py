"""A rank that stalls or dies mid-step: the others raise a CollectiveError naming the
bucket and the collective within the model's timeout, instead of hanging, and their
local shards are as they were before the step.

Stalls run in one spawn of W = 3 ranks, each scenario on a fresh process group (the
one it broke stays broken): rank 2 sleeps past the timeout at one blocking point of the
runtime, then abandons the scenario. Kills (SIGKILL, os._exit) need a spawn each.
"""

from __future__ import annotations

import datetime
import functools
import math
import os
import queue
import re
import signal
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.autograd import Variable

import flexshard as fs
from flexshard.optim import DistMuon
from flexshard.runtime.bucket import slot_of as fs_slot_of
from flexshard.runtime.collectives import (
    DEFAULT_TIMEOUT,
    CollectiveError,
    Pending,
    backend_failures_raise,
)
from flexshard.testing import TinyTransformer, TransformerConfig, make_batches, run_distributed
from flexshard.testing.collectives import record_collectives
from flexshard.testing.launch import next_result, start_ranks

W = 3
VICTIM = 2
TIMEOUT = datetime.timedelta(seconds=2)
STALL = 3.0  # seconds the victim sleeps: past the survivors' timeout
# where no rank stalls: long enough that a loaded machine's slow step is not a failure
# (a killed rank is noticed by gloo's closed connection, or by this)
SLOW_MACHINE_TIMEOUT = datetime.timedelta(seconds=30)
BUCKETS = [
    fs.BucketSpec("layers.0.*", name="layer0"),
    fs.BucketSpec("layers.1.*", placement=fs.Owned(), name="layer1"),
    fs.BucketSpec(["embed.*", "norm.*", "head.*"], name="outer"),
]


def run_tolerant(fn: Callable, world_size: int, *args: Any, timeout: float) -> list[Any]:
    """``run_distributed`` that expects ranks to die: the result of each rank that
    reported within ``timeout`` (None for the others); a child's error is re-raised."""
    procs, results = start_ranks(fn, world_size, args)
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < world_size and time.monotonic() < deadline:
            if len(out) + sum(not p.is_alive() and p.exitcode != 0 for p in procs) >= world_size:
                break  # every rank reported or died
            try:
                rank, status, value = next_result(results, 0.5)
            except queue.Empty:
                continue
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            out[rank] = value
    finally:
        for proc in procs:  # survivors may block in destroy_process_group on a dead peer
            proc.join(timeout=1)
            if proc.is_alive():
                proc.kill()
    return [out.get(r) for r in range(world_size)]


def _exit_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        os._exit(3)
    return rank


def test_run_distributed_reports_a_rank_gone_without_a_word():
    """A rank that exits without putting a result (a crash, a signal) ends the wait
    with its exit code; before, the launcher waited out its timeout (TimeoutError)."""
    with pytest.raises(RuntimeError, match="rank 1 exit code 3"):
        run_distributed(_exit_on_rank_one, 2, timeout=240)


class _Stalled(Exception):
    """Raised in the victim once it has slept: it abandons the scenario."""


def _stall() -> None:
    time.sleep(STALL)
    raise _Stalled


def _train(model, opt, batches, rank: int, steps: range, arm: Callable[[], None]) -> None:
    for step in steps:
        if step == 1:
            arm()  # the fault strikes in the second step
        tokens, targets = batches[step * W + rank]
        model.loss(tokens, targets).backward()
        opt.step()
        opt.zero_grad()


def _arm(model: TinyTransformer, where: str, fault: Callable[[], None]) -> None:
    """Make ``fault`` happen at ``where`` in this rank's next step."""

    def on_grad(module, args, output) -> None:
        if where == "backward":  # in the middle of backward: after layer 1's gradients
            output.register_hook(lambda grad: fault())
        else:  # after the whole backward, before flexshard's end-of-backward wait
            output.register_hook(lambda grad: Variable._execution_engine.queue_callback(fault))

    if where == "forward":  # before flexshard's own pre-hook of layer 1
        model.layers[1].register_forward_pre_hook(lambda *_: fault(), prepend=True)
    else:  # the head's output gradient is the first of the backward
        (model.layers[1] if where == "backward" else model.head).register_forward_hook(on_grad)


def _snapshot(model: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The local shards (what the optimizer holds) and a copy of their values; compared
    locally, since a peer may be dead (DTensor's torch.equal would all-reduce)."""
    return [(p.to_local(), p.to_local().detach().clone()) for p in model.parameters()]


def _outcome(model, before, started: float, err: BaseException | None) -> dict:
    return {
        "error": None if err is None else (type(err).__name__, str(err)),
        "bucket": getattr(err, "bucket", None),
        "collective": getattr(err, "collective", None),
        "seconds": time.monotonic() - started,
        "unchanged": before is not None and all(torch.equal(p, copy) for p, copy in before),
    }


SCENARIOS = (
    "set_up",
    "forward",
    "backward",
    "end_of_backward",
    "full_state_dict",
    "clip",
    "dist_muon",
)


def _stall_cases(rank: int, world_size: int) -> dict:
    cfg = TransformerConfig()
    batches = make_batches(cfg, 2 * W, batch=2, seed=3)
    out = {}
    for scenario in SCENARIOS:
        # a fresh group per scenario; gloo's own timeout (30 min) is not the one that fires
        group = dist.new_group()
        torch.manual_seed(0)
        model = TinyTransformer(cfg)
        victim = rank == VICTIM
        before, err, started = None, None, time.monotonic()
        try:
            if scenario == "set_up":
                # the agreement all-gather runs on the group's own timeout
                short = dist.new_group(timeout=TIMEOUT)
                if victim:
                    _stall()
                started = time.monotonic()
                fs.flex_shard(model, mesh=short, buckets=BUCKETS, timeout=TIMEOUT)
                continue
            model = fs.flex_shard(model, mesh=group, buckets=BUCKETS, timeout=TIMEOUT)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            if scenario == "full_state_dict":
                _train(model, opt, batches, rank, range(1), lambda: None)
                before, started = _snapshot(model), time.monotonic()
                if victim:
                    _stall()
                fs.full_state_dict(model)
                continue
            if scenario in ("clip", "dist_muon"):  # the optimizer side, after a backward
                tokens, targets = batches[rank]
                model.loss(tokens, targets).backward()
                before, started = _snapshot(model), time.monotonic()
                if victim:
                    _stall()
                if scenario == "clip":
                    fs.clip_grad_norm_(model, 1.0)
                else:  # layer0 is Shard(0): its matrices travel to their owners
                    matrices = [
                        p
                        for n, p in model.named_parameters()
                        if n.startswith("layers.0.") and p.ndim == 2
                    ]
                    DistMuon(matrices, lr=0.02).step()
                continue
            arm = functools.partial(_arm, model, scenario, _stall) if victim else (lambda: None)
            _train(model, opt, batches, rank, range(1), arm)
            before, started = _snapshot(model), time.monotonic()
            _train(model, opt, batches, rank, range(1, 2), arm)
        except _Stalled:
            err = None
        except Exception as caught:
            err = caught
        finally:
            if not (victim and scenario == "set_up"):
                out[scenario] = _outcome(model, before, started, err)
        if err is not None and scenario != "set_up":  # later calls re-raise, never hang
            try:
                model.reshard()
                out[scenario]["again"] = None
            except fs.CollectiveError as again:
                out[scenario]["again"] = str(again)
    return out


@pytest.fixture(scope="module")
def stalls() -> list[dict]:
    return run_tolerant(_stall_cases, W, timeout=120)


EXPECTED = {  # scenario: (collective, bucket) the survivors name
    "set_up": ("set-up agreement all-gather", "layer0, layer1, outer"),
    "forward": ("all-gather", "layer1"),
    "backward": ("reduce-scatter", "layer1"),
    "end_of_backward": ("reduce-scatter", "outer"),
    "full_state_dict": ("all-gather", "outer"),
    "clip": ("clip_grad_norm_ all-reduce", "layer0, layer1, outer"),
    "dist_muon": ("DistMuon forward all-to-all", "layer0"),
}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_a_stalled_rank_makes_the_others_raise_naming_bucket_and_collective(stalls, scenario):
    collective, bucket = EXPECTED[scenario]
    for rank in range(W):
        if rank == VICTIM:
            continue
        got = stalls[rank][scenario]
        assert got["error"] is not None and got["error"][0] == "CollectiveError", got
        assert (got["collective"], got["bucket"]) == (collective, bucket), got
        message = got["error"][1]
        assert f"{collective} of bucket '{bucket}'" in message
        assert f"on rank {rank}" in message and "stalled" in message


@pytest.mark.parametrize("scenario", sorted(set(SCENARIOS) - {"set_up"}))
def test_the_runtime_timeout_is_the_models(stalls, scenario):
    """The error quotes the flex_shard timeout (not gloo's 30 minutes) and says it ran out."""
    for rank in (0, 1):
        assert "did not complete within the timeout (2 s)" in stalls[rank][scenario]["error"][1]


@pytest.mark.parametrize("scenario", sorted(set(SCENARIOS) - {"set_up"}))
def test_no_data_lost_and_later_calls_raise_the_same_error(stalls, scenario):
    for rank in (0, 1):
        got = stalls[rank][scenario]
        assert got["unchanged"], got
        if scenario == "forward":  # a bucket left mid-gather raises again, frees nothing
            assert got["again"] == got["error"][1]


def test_the_default_timeout_is_at_most_five_minutes():
    assert datetime.timedelta(0) < DEFAULT_TIMEOUT <= datetime.timedelta(minutes=5)


def _killed_mid_step(rank: int, world_size: int, how: str, where: str) -> dict:
    """Rank 2 dies at ``where`` in step 2: the survivors fail in their next collective
    that needs it, by gloo's closed connection or our timeout."""
    cfg = TransformerConfig()
    batches = make_batches(cfg, 2 * W, batch=2, seed=3)
    torch.manual_seed(0)
    model = fs.flex_shard(
        TinyTransformer(cfg), mesh=None, buckets=BUCKETS, timeout=SLOW_MACHINE_TIMEOUT
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    die = {"sigkill": lambda: os.kill(os.getpid(), signal.SIGKILL), "exit": lambda: os._exit(3)}
    arm = functools.partial(_arm, model, where, die[how]) if rank == VICTIM else (lambda: None)
    _train(model, opt, batches, rank, range(1), arm)
    before, started, err = _snapshot(model), time.monotonic(), None
    try:
        _train(model, opt, batches, rank, range(1, 2), arm)
    except Exception as caught:
        err = caught
    return _outcome(model, before, started, err)


@pytest.mark.parametrize("how, where", [("sigkill", "forward"), ("exit", "end_of_backward")])
def test_a_killed_rank_makes_the_others_raise_naming_bucket_and_collective(how, where):
    results = run_tolerant(_killed_mid_step, W, how, where, timeout=60)
    assert results[VICTIM] is None  # it died without a word
    for rank in (0, 1):
        got = results[rank]
        assert got["error"] is not None and got["error"][0] == "CollectiveError", got
        assert got["collective"] in ("all-gather", "reduce-scatter"), got
        assert got["bucket"] in ("layer0", "layer1", "outer"), got
        assert f"{got['collective']} of bucket '{got['bucket']}'" in got["error"][1]
        assert got["unchanged"], got


# ------------------------------------------------ whichever wait notices first
#: a Python exception line ("pkg.Class: message"), the first one a user reads
ERROR_LINE = re.compile(r"^([\w.]*(?:Error|Exception)): (.*)$")
#: what gloo's own timeout raises from ``work.wait()`` (torch 2.13, a RuntimeError)
GLOO_TIMEOUT = (
    "[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out "
    "waiting 200ms for recv operation to complete"
)


def first_error_line(text: str, prefix: str = "") -> tuple[str, str] | None:
    """(exception class, message) of the first exception line of ``text`` (a printed
    traceback; ``prefix``: what starts each line of the rank's output)."""
    for line in text.splitlines():
        if line.startswith(prefix) and (found := ERROR_LINE.match(line[len(prefix) :])):
            return found.group(1), found.group(2)
    return None


class _Work:
    """A collective's work that ends as a stalled peer makes it end: ``raises`` after
    ``seconds`` (the backend's timeout, or c10d's bounded wait giving up), or never."""

    def __init__(self, raises: BaseException | None, seconds: float) -> None:
        self.raises, self.seconds = raises, seconds

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if self.raises is None:  # gloo's reduce-scatter: blocks past any timeout
            threading.Event().wait()
        time.sleep(self.seconds)
        raise self.raises


WAITS = {  # which wait notices first: (work, wait_ignores_timeout, backend words)
    "flexshard's bounded wait": (_Work(RuntimeError("Operation timed out!"), 0.2), False, None),
    "flexshard's wait thread": (_Work(None, 0), True, None),
    # its clock starts when gloo's thread runs the collective: earlier here, so it wins
    "gloo's own timeout": (_Work(RuntimeError(GLOO_TIMEOUT), 0.1), False, "Timed out waiting"),
    "gloo's timeout, reduce-scatter": (_Work(RuntimeError(GLOO_TIMEOUT), 0.1), True, "Timed"),
    "a peer gone": (_Work(RuntimeError("Connection reset by peer"), 0), False, "Connection"),
}


@pytest.mark.parametrize("wait", WAITS)
def test_whichever_wait_notices_first_the_first_error_line_names_the_collective(
    one_rank_group, wait
):
    work, ignores_timeout, backend = WAITS[wait]
    timeout = datetime.timedelta(seconds=0.2)
    pending = Pending(work, "all-gather", "outer", timeout, one_rank_group, ignores_timeout)
    with pytest.raises(CollectiveError) as caught:
        pending.wait()
    err = caught.value
    printed = "".join(traceback.format_exception(err))
    name, message = first_error_line(printed)
    assert name.endswith("CollectiveError") and "The above exception" not in printed, printed
    assert re.match(
        r"flexshard: all-gather of bucket 'outer' (did not complete within the timeout "
        r"\(0.2 s\)|failed 0.\d s after launch \(timeout 0.2 s\)) on rank 0 \(group ranks \[0\]\)",
        message,
    ), message
    if backend is None:  # flexshard's own timeout: no backend words, nothing kept
        assert "[backend:" not in message and err.backend_error is None
    else:
        assert backend in message.partition(" [backend: ")[2], message
        assert err.backend_error is work.raises
    with pytest.raises(CollectiveError) as again:  # sticky, and still not chained
        pending.wait()
    assert again.value is err and "The above" not in "".join(traceback.format_exception(err))


def test_a_backend_failure_of_torchs_own_collective_is_named_first(one_rank_group):
    def error(err: BaseException, cause: str) -> CollectiveError:
        return CollectiveError(f"flexshard: TP redistribution [backend: {cause}]", bucket="b",
                               collective="c", rank=0)  # fmt: skip

    gloo = RuntimeError(GLOO_TIMEOUT + "\nException raised from recv at ...")
    with pytest.raises(CollectiveError) as caught, backend_failures_raise(error):
        raise gloo
    printed = "".join(traceback.format_exception(caught.value))
    assert first_error_line(printed) == (
        "flexshard.runtime.collectives.CollectiveError",
        f"flexshard: TP redistribution [backend: {GLOO_TIMEOUT}]",
    )
    assert "The above exception" not in printed and caught.value.backend_error is gloo


# ----------------------------------------------------------- finite-gradient check
def _poison(model, fqn: str, value: float) -> Any:
    """Put ``value`` into this rank's unsharded gradient of ``fqn`` (before reduction)."""
    local = model.get_parameter(fqn)
    bucket, index = fs_slot_of(local)

    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad.view(-1)[0] = value
        return grad

    return bucket.full_params[index].register_hook(hook)


def _finite_check_cases(rank: int, world_size: int) -> dict:
    cfg = TransformerConfig()
    batches = make_batches(cfg, 4 * W, batch=2, seed=4)
    models, logs, losses = {}, {}, {}
    for check in (False, True):
        torch.manual_seed(0)
        model = fs.flex_shard(
            TinyTransformer(cfg), mesh=None, buckets=BUCKETS, timeout=SLOW_MACHINE_TIMEOUT
        )
        model.set_check_finite_grads(check)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses[check] = []
        with record_collectives() as log:  # every collective of the two steps
            for step in range(2):  # clean steps: the check changes nothing but one all-gather
                tokens, targets = batches[step * W + rank]
                loss = model.loss(tokens, targets)
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses[check].append(loss.item())
        logs[check] = dict(log.counts())
        models[check] = (model, opt)
    model, opt = models[True]
    out: dict[str, Any] = {"losses": losses, "collectives": logs}
    # rank 1 alone gets a NaN in one weight's gradient, rank 2 an inf in another's
    hooks = []
    if rank == 1:
        hooks.append(_poison(model, "layers.1.up.weight", float("nan")))
    if rank == 2:
        hooks.append(_poison(model, "head.weight", float("inf")))
    before = _snapshot(model)
    tokens, targets = batches[2 * W + rank]
    try:
        model.loss(tokens, targets).backward()
        out["error"] = None
        opt.step()
    except FloatingPointError as err:
        out["error"] = str(err)
    out["unchanged"] = all(torch.equal(p, copy) for p, copy in before)
    for hook in hooks:
        hook.remove()
    opt.zero_grad()  # the ranks are still in step: the next step trains
    tokens, targets = batches[3 * W + rank]
    loss = model.loss(tokens, targets)
    loss.backward()
    opt.step()
    out["next_loss"] = loss.item()
    opt.zero_grad()
    # gradient accumulation: a no-sync backward holds its gradients, and is checked too
    model.set_requires_gradient_sync(False)
    hooks = [_poison(model, "layers.0.qkv.weight", float("nan"))] if rank == 0 else []
    try:
        model.loss(tokens, targets).backward()
        out["no_sync_error"] = None
    except FloatingPointError as err:
        out["no_sync_error"] = str(err)
    return out


@pytest.fixture(scope="module")
def finite_checks() -> list[dict]:
    return run_distributed(_finite_check_cases, W, timeout=120)


def test_finite_check_off_adds_no_collective_and_on_adds_one_per_backward(finite_checks):
    for per_rank in finite_checks:
        off, on = (Counter(per_rank["collectives"][c]) for c in (False, True))
        # positive control: the log sees the steps' gathers and reduce-scatters
        assert off["all_gather_single"] > 0 and off["reduce_scatter_single"] > 0, off
        assert on - off == Counter(all_gather_single=2) and off - on == Counter(), (on, off)
        assert per_rank["losses"][True] == per_rank["losses"][False]


def test_a_nan_on_one_rank_raises_the_same_error_on_every_rank(finite_checks):
    errors = [per_rank["error"] for per_rank in finite_checks]
    assert errors[0] is not None and errors == [errors[0]] * W
    assert "parameter 'layers.1.up.weight' of bucket 'layer1' (NaN on rank 1)" in errors[0]
    assert "parameter 'head.weight' of bucket 'outer' (inf on rank 2)" in errors[0]
    assert "2 parameter(s)" in errors[0]


def test_after_the_error_nothing_changed_and_the_next_step_trains(finite_checks):
    for per_rank in finite_checks:
        assert per_rank["unchanged"]
        assert math.isfinite(per_rank["next_loss"])


def test_a_no_sync_backward_is_checked_too(finite_checks):
    errors = [per_rank["no_sync_error"] for per_rank in finite_checks]
    assert errors[0] is not None and errors == [errors[0]] * W
    assert "parameter 'layers.0.qkv.weight' of bucket 'layer0' (NaN on rank 0)" in errors[0]
