"""FlexShardModule: the methods a sharded module gains (FSDP2's FSDPModule names)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, UnshardHandle

from ..torch_internals import (
    STATE_KEY,
    GradientReductionHandle,
    fully_shard_state_key,
    in_autograd_backward,
)
from .bucket import Bucket
from .collectives import subtree_traffic, summed
from .hooks import MANUAL_FINALIZATION, StepState, manual_finalization


def own_buckets(module: nn.Module) -> list[Bucket]:
    """The buckets ``flex_shard``/``fully_shard`` attached to ``module`` itself (none:
    not sharded by flexshard)."""
    return list(getattr(module, "_flexshard_buckets", ()))


def subtree_buckets(module: nn.Module) -> Iterator[Bucket]:
    """Every bucket below ``module`` once (``fully_shard([a, b])`` lists one on both)."""
    seen: set[int] = set()
    for m in module.modules():
        for bucket in own_buckets(m):
            if id(bucket) not in seen:
                seen.add(id(bucket))
                yield bucket


def _check_bool(method: str, name: str, value: object) -> None:
    # a truthy string ("no") would silently mean True
    if not isinstance(value, bool):
        raise TypeError(f"{method}: {name} must be a bool, got {value!r}")


class FlexUnshardHandle(UnshardHandle):
    """What ``unshard(async_op=True)`` returns: ``wait()`` lands the all-gathers."""

    def __init__(self, buckets: list[Bucket]) -> None:
        self._buckets = buckets

    def wait(self) -> None:
        for bucket in self._buckets:
            bucket.unshard()


class FlexGradientReductionHandle(GradientReductionHandle):
    """What ``finalize_backward(async_op=True)`` returns: ``wait()`` lands the gradient
    reductions and finishes the gradients (once; later calls return at once)."""

    def __init__(self, state: StepState | None, token: object | None) -> None:
        self._state = state
        self._token = token

    def wait(self) -> None:
        if self._state is None:
            return
        self._state.finish_finalization(self._token)
        self._state = self._token = None


class _ForwardHooks:
    """What ``register_fsdp_forward_method`` calls around a custom forward method
    (torch's reaches it through ``_get_fsdp_state()``): the module's own forward hooks."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        for hook in module._forward_pre_hooks.values():
            if hook in getattr(module, "_flexshard_hooks", ()):
                result = hook(module, args, kwargs) if _takes_kwargs(hook) else hook(module, args)
                if isinstance(result, tuple) and len(result) == 2 and _takes_kwargs(hook):
                    args, kwargs = result
        return args, kwargs

    def _post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        for hook in module._forward_hooks.values():
            if hook in getattr(module, "_flexshard_hooks", ()):
                result = (
                    hook(module, args, {}, output)
                    if _takes_kwargs(hook)
                    else hook(module, args, output)
                )
                output = output if result is None else result
        return output


def _takes_kwargs(hook: Any) -> bool:
    return getattr(hook, "_flexshard_kwargs", False)


#: FSDP2 methods that tune its own buffers and streams; flexshard has no counterpart
_NOT_APPLICABLE = {
    "set_custom_all_gather": "a placement chooses its bucket's all-gather",
    "set_custom_reduce_scatter": "a placement chooses its bucket's reduce-scatter",
    "set_separate_reduce_scatter_group": "a bucket reduces on its own shard group",
    "set_allocate_memory_from_process_group_for_comm": "no NCCL memory pools on this runtime",
    "set_symm_mem_for_comm": "no symmetric-memory collectives on this runtime",
    "_set_unshard_async_op": "flexshard's forward all-gathers are already asynchronous",
    "set_keep_unsharded_storage": (
        "a bucket's reshard always frees its all-gather buffer; keeping it for stable "
        "data pointers (CUDA graph capture) is not implemented"
    ),
}


def _not_applicable(name: str, why: str) -> Callable[..., None]:
    def method(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(f"{name}: not supported by flexshard ({why})")

    method.__name__ = name
    return method


class FlexShardModule(FSDPModule, nn.Module):
    """Mixed into the class of every module that ``flex_shard``/``fully_shard`` wrapped;
    an ``FSDPModule`` to torch, with FSDP2's methods."""

    # FlexShard<Orig> -> FlexShardModule -> FSDPModule -> Orig: FSDPModule.__new__
    # (indexing a container builds a plain Orig) finds the original class here
    _orig_cls_mro_index = 3
    _flexshard_buckets: list[Bucket]

    def _get_fsdp_state(self) -> Any:  # type: ignore[override]
        return _ForwardHooks(self)

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's buckets; with ``async_op`` return a handle to wait on."""
        _check_bool("unshard", "async_op", async_op)
        buckets = list(self._flexshard_buckets)
        state = getattr(self, "_flexshard_state", None)
        in_backward = state is not None and state.in_backward
        for bucket in buckets:
            bucket.unshard(async_op=True, overlap=not in_backward)
        handle = FlexUnshardHandle(buckets)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        for bucket in self._flexshard_buckets:
            bucket.reshard()

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """False: keep unsharded gradients across backward passes and reduce nothing
        (gradient accumulation); the next backward with True reduces the sum."""
        _check_bool("set_requires_gradient_sync", "requires_gradient_sync", requires_gradient_sync)
        _check_bool("set_requires_gradient_sync", "recurse", recurse)
        buckets = subtree_buckets(self) if recurse else self._flexshard_buckets
        state = self.__dict__.get("_flexshard_state")
        if recurse and state is not None and state.root is self:
            buckets = state.buckets  # the same buckets, without a walk (once per microbatch)
        for bucket in buckets:
            bucket.schedule.requires_grad_sync = requires_gradient_sync

    def set_reshard_after_forward(
        self, reshard_after_forward: bool, *, recurse: bool = True
    ) -> None:
        _check_bool("set_reshard_after_forward", "reshard_after_forward", reshard_after_forward)
        _check_bool("set_reshard_after_forward", "recurse", recurse)
        buckets = subtree_buckets(self) if recurse else self._flexshard_buckets
        for bucket in buckets:
            bucket.schedule.reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(
        self, reshard_after_backward: bool, *, recurse: bool = True
    ) -> None:
        """False: keep the gathered parameters after backward, so the next microbatch's
        forward and backward need no all-gather (pipeline schedules set it for every
        microbatch but the last, as torch does for FSDP2)."""
        _check_bool("set_reshard_after_backward", "reshard_after_backward", reshard_after_backward)
        _check_bool("set_reshard_after_backward", "recurse", recurse)
        buckets = subtree_buckets(self) if recurse else self._flexshard_buckets
        for bucket in buckets:
            bucket.schedule.reshard_after_backward = reshard_after_backward

    def set_check_finite_grads(self, check_finite_grads: bool, *, recurse: bool = True) -> None:
        """True: after every backward, raise FloatingPointError on every rank if a
        gradient holds a NaN or an inf on any rank, naming the parameter, bucket and
        rank (one small all-gather per backward). Off (default): no cost at all. Every
        rank must set the same."""
        _check_bool("set_check_finite_grads", "check_finite_grads", check_finite_grads)
        _check_bool("set_check_finite_grads", "recurse", recurse)
        buckets = subtree_buckets(self) if recurse else self._flexshard_buckets
        for bucket in buckets:
            bucket.grads.check_finite = check_finite_grads

    def comm_stats(self, reset: bool = False) -> dict[str, dict[str, int]]:
        """Per bucket: collectives issued and bytes this rank sent and received since
        the last reset; per kind of traffic attached below this module
        (``attach_traffic``: e.g. ``"ep"``, ``"cp"``, which also count ``all_to_all``
        and ``send_recv`` calls); and a ``"total"`` entry summing them all."""
        _check_bool("comm_stats", "reset", reset)
        stats: dict[str, dict[str, int]] = {}
        total: dict[str, int] = {}
        for bucket in subtree_buckets(self):
            entry = bucket.comm.stats.as_dict()
            key, copy = bucket.name, 1
            while key in stats:  # fully_shard buckets share a class name until named
                copy += 1
                key = f"{bucket.name}#{copy}"
            stats[key] = entry
            if reset:
                bucket.comm.reset_stats()
        for kind, entries in subtree_traffic(self).items():
            if kind in stats:
                raise ValueError(
                    f"comm_stats: bucket '{kind}' has the name of the '{kind}' traffic "
                    "entry (attach_traffic); give the bucket another name"
                )
            stats[kind] = summed(entries)
            if reset:
                for one in entries:
                    one.reset()
        for entry in stats.values():
            for key, value in entry.items():
                total[key] = total.get(key, 0) + value
        stats["total"] = total
        return stats

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        # nn.Module._apply gives every parameter a new tensor (to_empty, .to(device)):
        # move the bucket storage the same way and make the parameters views again
        for bucket in self._flexshard_buckets:
            bucket.reshard()
        nn.Module._apply(self, fn, recurse)  # FSDPModule._apply expects FSDP2 state
        for bucket in self._flexshard_buckets:
            bucket.rebind_storage(fn)
        return self

    # ------------------------------------------------------------ FSDP2's setters
    def _set_on_buckets(self, part: str, attr: str, value: object, recurse: bool) -> None:
        """``attr`` of each bucket's ``part`` (its schedule or reduction)."""
        buckets = subtree_buckets(self) if recurse else self._flexshard_buckets
        for bucket in buckets:
            setattr(getattr(bucket, part), attr, value)

    def set_modules_to_forward_prefetch(self, modules: list[nn.Module]) -> None:
        """Gather these modules' buckets (asynchronously) when this module's forward
        starts, instead of the next bucket of the recorded forward order."""
        self._set_on_buckets("schedule", "forward_prefetch", _buckets_of(modules), recurse=False)

    def set_modules_to_backward_prefetch(self, modules: list[nn.Module]) -> None:
        """Gather these modules' buckets when this module's backward starts."""
        self._set_on_buckets("schedule", "backward_prefetch", _buckets_of(modules), recurse=False)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted for FSDP2 code: flexshard completes every reduction it launched at
        the end of each backward (or at ``finalize_backward`` under manual backward
        finalization), so there is nothing left to defer."""
        _check_bool("set_is_last_backward", "is_last_backward", is_last_backward)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: False reduce-scatters but skips the all-reduce across replicas (the
        gradient accumulates per replica); the next True all-reduces the sum."""
        _check_bool("set_requires_all_reduce", "requires_all_reduce", requires_all_reduce)
        self._set_on_buckets("reduction", "requires_all_reduce", requires_all_reduce, recurse)

    def set_reduce_scatter_unused_params(
        self, reduce_scatter_unused_params: bool, *, recurse: bool = True
    ) -> None:
        """True: a parameter with no gradient on any rank gets a zero one, as FSDP2's
        option gives it (no agreement needed). By default it keeps None, as FSDP2's
        default does (runtime/hooks.py); flexshard reduces zeros for a parameter
        unused on some ranks only either way, so no default can leave the ranks'
        reduce-scatters out of step."""
        name = "set_reduce_scatter_unused_params"
        _check_bool(name, "reduce_scatter_unused_params", reduce_scatter_unused_params)
        self._set_on_buckets("reduction", "reduce_unused", reduce_scatter_unused_params, recurse)

    def set_agree_on_unused_params(self, agree: bool, *, recurse: bool = True) -> None:
        """True (``flex_shard``'s default): at the end of each backward the ranks agree,
        with one small all-reduce (MAX over one int32 per trainable parameter, per
        process group), on the parameters no rank used; those keep ``.grad`` None, and a
        parameter used on some ranks only gets its reduced gradient everywhere. False
        (``fully_shard``'s default: FSDP2's collectives exactly): each rank decides
        alone (runtime/reduce.py ``_settle_here``)."""
        _check_bool("set_agree_on_unused_params", "agree", agree)
        self._set_on_buckets("reduction", "agree_on_unused", agree, recurse)

    def set_reduce_scatter_max_input_buffers(
        self, max_input_buffers: int, *, recurse: bool = True
    ) -> None:
        """At most ``max_input_buffers`` gradient reductions (each holding its input
        buffer) stay in flight once one of these buckets launched its own; the oldest
        land first (they land after the launch, so one more buffer exists meanwhile).
        Default 1, as FSDP2's; more overlaps more of the reductions for more memory."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(
                "set_reduce_scatter_max_input_buffers: max_input_buffers must be an int, "
                f"got {type(max_input_buffers).__name__}"
            )
        if max_input_buffers < 1:
            raise ValueError(
                "set_reduce_scatter_max_input_buffers: max_input_buffers must be a "
                f"positive int, got {max_input_buffers}"
            )
        self._set_on_buckets("schedule", "reductions_in_flight", max_input_buffers, recurse)

    def set_post_optim_event(self, event: Any) -> None:
        """The next all-gathers wait on ``event`` (an optimizer run on another stream)
        besides the current stream, which they always follow (no-op on CPU)."""
        self._set_on_buckets("schedule", "post_optim_event", event, recurse=True)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide reduced gradients by ``factor`` instead of the data-parallel size."""
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
            raise ValueError(f"set_gradient_divide_factor: factor must be > 0, got {factor!r}")
        self._set_on_buckets("reduction", "divide_factor", float(factor), recurse=True)

    set_reduce_scatter_divide_factor = set_gradient_divide_factor

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Reduce with SUM and divide afterwards (instead of AVG in the collective)."""
        _check_bool("set_force_sum_reduction_for_comms", "enable", enable)
        self._set_on_buckets("reduction", "force_sum", enable, recurse=True)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """False: do not all-gather this module's buckets in backward (for parameters
        its backward does not use)."""
        _check_bool("set_unshard_in_backward", "unshard_in_backward", unshard_in_backward)
        self._set_on_buckets("schedule", "unshard_in_backward", unshard_in_backward, recurse=False)

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *, stream=None) -> None:
        """Call ``hook(reduced)`` on each bucket's reduced gradient buffer (after the
        HSDP all-reduce), before it becomes the parameters' ``.grad``."""
        if not callable(hook):
            raise TypeError(f"set_all_reduce_hook: hook must be callable, got {hook!r}")
        self._set_on_buckets("reduction", "all_reduce_hook", hook, recurse=False)

    def _root_state(self, method: str) -> StepState | None:
        """This module's StepState (None before the first forward), refusing a module
        that is not the root, as FSDP2 does."""
        state = getattr(self, "_flexshard_state", None)
        if state is not None and state.root is not self:
            raise RuntimeError(f"{method} must be called on the root FSDP module")
        return state

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """True: the end of a backward neither waits for the gradient reductions nor
        finishes the gradients; ``finalize_backward`` does, after every backward of the
        step (torch's pipeline schedules reduce as an action of their own). Call it on
        the root, before the backward; the mode stays fixed until that finalization."""
        _check_bool("set_manual_backward_finalization", "enabled", enabled)
        state = self._root_state("set_manual_backward_finalization")
        if enabled != manual_finalization(self) and in_autograd_backward():
            raise RuntimeError(
                "set_manual_backward_finalization cannot change mode during backward"
            )
        if state is not None and state.manual_active is not None and enabled != state.manual_active:
            raise RuntimeError(
                "set_manual_backward_finalization cannot change mode after backward starts"
            )
        self.__dict__[MANUAL_FINALIZATION] = enabled

    def finalize_backward(self, *, async_op: bool = False) -> GradientReductionHandle | None:
        """Under manual finalization, after the step's backwards: reduce the gradients
        still owed (with the current gradient sync and reshard settings), wait for every
        reduction and finish the gradients. ``async_op``: launch them and return a
        handle whose ``wait()`` does the rest; it must be waited on before the next
        forward or finalization. Before the first forward: nothing to do."""
        _check_bool("finalize_backward", "async_op", async_op)
        state = getattr(self, "_flexshard_state", None)
        if state is None:
            return FlexGradientReductionHandle(None, None) if async_op else None
        if state.pending_finalization is not None:
            raise RuntimeError(
                "The previous gradient reduction must be waited on before finalizing backward again"
            )
        self._root_state("finalize_backward")
        active = state.manual_active
        if not (manual_finalization(self) if active is None else active):
            raise RuntimeError(
                "FSDP finalize_backward requires manual backward finalization. Call "
                "set_manual_backward_finalization(True) before forward"
            )
        if state.in_backward:
            raise RuntimeError("FSDP finalize_backward must be called after backward completes")
        state.finalize(wait=not async_op)
        if not async_op:
            return None
        return FlexGradientReductionHandle(state, state.pending_finalization)

    def reset_iter_state(self) -> None:
        """Forget the step in progress (after an exception in forward or backward)."""
        state = getattr(self, "_flexshard_state", None)
        if state is not None:
            state._reset_step()
        for bucket in subtree_buckets(self):
            bucket.reshard()


for _name, _why in _NOT_APPLICABLE.items():
    setattr(FlexShardModule, _name, _not_applicable(_name, _why))


def _buckets_of(modules: list[nn.Module]) -> list[Bucket]:
    out = []
    for module in modules:
        if not isinstance(module, FlexShardModule):
            raise TypeError(f"expected modules sharded by flexshard, got {type(module).__name__}")
        out.extend(module._flexshard_buckets)
    return out


class _PipelineState:
    """What torch's pipeline stages use through ``fully_shard.state(module)``: they run
    every microbatch's backward with gradient sync off, then, after the last, call
    ``_root_post_backward_final_callback``: reduce the held gradients here."""

    class _Context:
        all_states: list = []  # no FSDP2 parameter groups to post-process

    _state_ctx = _Context()

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def _root_post_backward_final_callback(self) -> None:
        buckets = list(subtree_buckets(self.module))  # the same order on every rank
        if not buckets:
            return
        state = buckets[0].step.state
        if state is not None:
            state.reduce_held(buckets)
            return
        # no forward built the model's state: a throwaway one, which must not leave its
        # agreement running (nobody would wait for it)
        state = StepState(self.module, buckets)
        state.reduce_held(buckets)
        state.agree_on_unused.finish()
        for bucket in buckets:
            bucket.step.state = None


def _register_pipeline_state(module: nn.Module) -> None:
    # torch.distributed.pipelining treats every FSDPModule as FSDP2's and asks
    # fully_shard.state(module) for its state: give it flexshard's
    module.__dict__.setdefault(STATE_KEY, {})[fully_shard_state_key()] = _PipelineState(module)


#: one FlexShard subclass per original class, as FSDP2 caches its own: modules of one
#: class keep one type, so a block compiled once serves every block (dynamo guards on
#: the type; a class per instance recompiled each block and hit the recompile limit)
_FLEX_CLASSES: dict[type, type] = {}


def make_flexshard_class(module: nn.Module) -> None:
    """Give ``module`` FlexShardModule's methods, as FSDP2 does with a dynamic subclass."""
    cls = type(module)
    if isinstance(module, FlexShardModule):
        return
    if cls not in _FLEX_CLASSES:
        _FLEX_CLASSES[cls] = type(f"FlexShard{cls.__name__}", (FlexShardModule, cls), {})
    module.__class__ = _FLEX_CLASSES[cls]
    _register_pipeline_state(module)
