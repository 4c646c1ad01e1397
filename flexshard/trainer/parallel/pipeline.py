"""Pipeline parallelism: the trainer's Transformer cut by layers into ``pp * virtual``
stages (embedding on the first, norm and output on the last; DeepSeek-V4's stages pass
its ``hc_mult`` residual streams and each takes the batch's token ids), run by
``torch.distributed.pipelining`` (GPipe, 1F1B, interleaved 1F1B), every stage module
sharded by flexshard over the data-parallel mesh.

torch's schedules know FSDP2 (``FSDPModule``) and DDP, not flexshard: ``FlexShardStage``
switches flexshard's gradient sync on for a stage's last microbatch backward only, so
each bucket accumulates unsharded gradients over the microbatches and reduces once per
step. Stage modules keep the full model's parameter names (``layers.5.attention...``),
so buckets, state dicts and checkpoints see one model whatever the layout.

One pipeline stage as flexshard needs it: torch's ``PipelineStage`` with flexshard's
gradient sync on the last microbatch only, its output checked against the static
shapes the next stage receives into, and the bytes it sends counted (under sequence
parallelism they are 1 / tp of the whole hidden states')."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

import flexshard as fs

from ..config import ConfigError
from .bounded_waits import in_flight


class StageOutputError(ValueError):
    """A stage's output differs from the static shape or dtype the next stage
    receives into."""


class FlexShardStage(PipelineStage):
    """A PipelineStage that turns flexshard's gradient sync and reshard-after-backward
    on only for the last microbatch's backward (torch does this for FSDP2 modules
    only), checks its output against the static shape and dtype the next stage
    receives into, and counts the bytes it sends (``sent_bytes``: activations forward,
    their gradients backward)."""

    def __init__(self, *args: Any, expected_output: torch.Tensor, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.expected_output = expected_output
        self.sent_bytes = {"forward": 0, "backward": 0}

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        ops = super().get_fwd_send_ops(fwd_chunk_id)
        self.sent_bytes["forward"] += _op_bytes(ops)
        return ops

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        ops = super().get_bwd_send_ops(bwd_chunk_id)
        self.sent_bytes["backward"] += _op_bytes(ops)
        return ops

    def forward_maybe_with_nosync(self, *args: Any, **kwargs: Any) -> Any:
        output = super().forward_maybe_with_nosync(*args, **kwargs)
        # checked here, before torch validates the output against the static metadata
        # (torch 2.11 always does, with an error that names neither activation_dtype
        # nor sequence_shards), so a mismatch raises flexshard's error on every release
        self._check_output(output)
        return output

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        except RuntimeError as err:
            # torch wraps errors of the forward in a RuntimeError listing the args
            if isinstance(err.__cause__, StageOutputError):
                raise err.__cause__ from None
            raise

    def _check_output(self, output: Any) -> None:
        want = self.expected_output
        if output.shape != want.shape or output.dtype != want.dtype:
            # torch 2.13 checks only under TORCH_DISTRIBUTED_DEBUG=DETAIL (and never
            # the last stage): else the receiver would read garbage
            raise StageOutputError(
                f"pipeline stage {self.stage_index}: output {output.dtype} "
                f"{tuple(output.shape)}, but the stages were built for {want.dtype} "
                f"{tuple(want.shape)} (activation_dtype / sequence_shards)"
            )

    def backward_maybe_with_nosync(
        self, backward_type: str, bwd_kwargs: dict, last_backward: bool = False
    ) -> Any:
        if isinstance(self.submod, fs.FlexShardModule):
            self.submod.set_requires_gradient_sync(last_backward)
            # gathered parameters serve the next microbatch; the last one frees them
            self.submod.set_reshard_after_backward(last_backward)
        return super().backward_maybe_with_nosync(
            backward_type, bwd_kwargs, last_backward=last_backward
        )


def _op_bytes(ops: list[dist.P2POp]) -> int:
    return sum(op.tensor.numel() * op.tensor.element_size() for op in ops)


SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
}


def check_pipeline(
    n_layers: int, pp: int, virtual: int, schedule: str, n_microbatches: int
) -> None:
    """The stages, the schedule and the microbatches fit together (run once, before
    any rank starts, by ``checked_dims``)."""
    if schedule not in SCHEDULES:
        raise ConfigError(f"pipeline schedule '{schedule}': must be one of {', '.join(SCHEDULES)}")
    for name, value in (
        ("pp", pp),
        ("virtual_stages", virtual),
        ("n_microbatches", n_microbatches),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"pipeline: {name} must be a positive int, got {value!r}")
    if virtual > 1 and schedule != "interleaved_1f1b":
        raise ConfigError(
            f"parallelism.pp_virtual_stages = {virtual} needs schedule 'interleaved_1f1b' "
            f"(parallelism.pp_schedule); '{schedule}' runs one stage per rank"
        )
    stages = pp * virtual
    if n_layers % stages:
        raise ConfigError(
            f"model.n_layers = {n_layers} is not divisible by pp * virtual_stages = "
            f"{pp} * {virtual}: parallelism.pp x pp_virtual_stages = {stages} stages do not "
            f"divide model.n_layers = {n_layers}"
        )
    if schedule == "1f1b" and n_microbatches < pp:
        raise ConfigError(
            f"parallelism.pp_microbatches = {n_microbatches}: 1f1b needs at least pp = {pp} "
            "(n_microbatches >= pp stages)"
        )
    if schedule == "interleaved_1f1b":
        rounds = max(1, n_microbatches // pp)
        if n_microbatches % rounds:
            raise ConfigError(
                f"parallelism.pp_microbatches = {n_microbatches}: interleaved_1f1b needs "
                f"n_microbatches to be a multiple of its rounds max(1, n_microbatches // pp) "
                f"= {rounds}"
            )


LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class StageLayers(nn.ModuleDict):
    """The blocks of one stage under their global indices ("4", "5"): parameter names
    stay those of the whole model. Iterates blocks, as the model's ModuleList does."""

    def __iter__(self) -> Iterator[nn.Module]:  # type: ignore[override]
        return iter(self.values())


def stage_ids(pp_rank: int, pp: int, virtual: int) -> list[int]:
    """Stages this rank runs: ``pp_rank, pp_rank + pp, ...`` (torch's loop placement)."""
    return [pp_rank + v * pp for v in range(virtual)]


def stage_layers(n_layers: int, n_stages: int, stage: int) -> range:
    per_stage = n_layers // n_stages
    return range(stage * per_stage, (stage + 1) * per_stage)


#: the parts after the blocks, on the last stage (``hc_head``: DeepSeek-V4's collapse
#: of its residual streams, before the norm)
LAST_STAGE_PARTS = ("hc_head", "norm", "output")


def split_model(model: nn.Module, n_stages: int, ids: list[int]) -> list[nn.Module]:
    """Cut the Transformer (``tok_embeddings``, ``layers``, ``norm``, ``output``; and
    DeepSeek-V4's ``hc_head``) into the stage modules ``ids``. The blocks move into the
    stages (no copy): ``model`` must not be used afterwards. A stage is a shell of the
    model whose missing parts are ``nn.Identity`` (hidden states pass through), so the
    model's own ``forward`` runs it."""
    last = [name for name in LAST_STAGE_PARTS if hasattr(model, name)]
    parts = {name: getattr(model, name) for name in ("tok_embeddings", "layers", *last)}
    for name in parts:  # a parameterless shell to copy: deepcopy never touches weights
        setattr(model, name, nn.Identity())
    try:
        shell = copy.deepcopy(model)
    finally:
        for name, part in parts.items():
            setattr(model, name, part)
    modules = []
    for stage in ids:
        module = copy.deepcopy(shell)
        span = stage_layers(len(parts["layers"]), n_stages, stage)
        module.layers = StageLayers({str(i): parts["layers"][i] for i in span})
        if stage == 0:
            module.tok_embeddings = parts["tok_embeddings"]
        if stage == n_stages - 1:
            for name in last:
                setattr(module, name, parts[name])
        modules.append(module)
    return modules


class PipelineRunner:
    """This rank's stages and the schedule that drives them.

    ``step(tokens, labels)`` runs forward and backward of one batch (every rank passes
    its data-parallel batch; stages take what they need) and returns the batch's mean
    loss on every pipeline rank. Gradients equal the full batch's (microbatch losses are
    means; the schedule divides by ``n_microbatches``). ``modules`` are the stage
    modules, for the optimizer, clipping and checkpoints."""

    def __init__(
        self,
        modules: list[nn.Module],
        ids: list[int],
        n_stages: int,
        pp_mesh: DeviceMesh,
        n_microbatches: int,
        schedule: str,
        loss_fn: LossFn,
        activation_dtype: torch.dtype,
        sequence_shards: int,
    ) -> None:
        self.modules = modules
        self.stage_ids = ids
        self.n_stages = n_stages
        self.pp_group = pp_mesh.get_group()
        self.n_microbatches = n_microbatches
        self.schedule_name = schedule
        self.loss_fn = loss_fn
        self.activation_dtype = activation_dtype
        self.sequence_shards = sequence_shards
        self._schedule: Any = None
        self._stages: list[FlexShardStage] = []
        self._batch_shape: tuple[int, ...] | None = None
        self._runs = 0  # schedule runs so far, for errors

    @property
    def has_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last(self) -> bool:
        return self.n_stages - 1 in self.stage_ids

    def _build_schedule(self, tokens: torch.Tensor) -> None:
        """Stages with static shapes (torch would otherwise infer them with a real
        forward and backward, which would run flexshard's collectives once more).
        Hidden states require grad: that is what makes a stage send its input's
        gradient back to the previous stage."""
        micro, seq = tokens.shape[0] // self.n_microbatches, tokens.shape[1]
        cfg, dtype, device = self.modules[0].cfg, self.activation_dtype, tokens.device
        hidden_seq = seq // self.sequence_shards  # sequence-parallel TP splits it further
        # [micro, seq, dim], or the model's own stage state (DeepSeek-V4's streams)
        state_dims = getattr(self.modules[0], "stage_state_dims", (cfg.dim,))
        hidden = torch.empty(
            micro, hidden_seq, *state_dims, dtype=dtype, device=device, requires_grad=True
        )
        logits = torch.empty(micro, seq, cfg.vocab_size, dtype=dtype, device=device)
        stages = []
        for module, stage in zip(self.modules, self.stage_ids):
            inputs = tokens[:micro] if stage == 0 else hidden
            outputs = logits.requires_grad_() if stage == self.n_stages - 1 else hidden
            stages.append(
                FlexShardStage(
                    module,
                    stage,
                    self.n_stages,
                    device,
                    input_args=inputs,
                    output_args=outputs,
                    group=self.pp_group,
                    expected_output=outputs,
                )
            )
        self._stages = stages
        kind = SCHEDULES[self.schedule_name]
        if kind is ScheduleInterleaved1F1B:
            self._schedule = kind(stages, self.n_microbatches, loss_fn=self.loss_fn)
        else:
            self._schedule = kind(stages[0], self.n_microbatches, loss_fn=self.loss_fn)

    def _check_batch(self, tokens: torch.Tensor, labels: torch.Tensor) -> None:
        if tokens.ndim != 2 or labels.shape != tokens.shape:
            raise ValueError(
                f"pipeline step: tokens and labels must be [batch, seq] of one shape, got "
                f"{tuple(tokens.shape)} and {tuple(labels.shape)}"
            )
        if tokens.shape[1] % self.sequence_shards:
            raise ValueError(
                f"pipeline step: sequence of {tokens.shape[1]} tokens is not divisible by "
                f"sequence_shards = {self.sequence_shards}"
            )
        if tokens.shape[0] % self.n_microbatches:
            raise ValueError(
                f"pipeline step: batch of {tokens.shape[0]} sequences is not divisible by "
                f"n_microbatches = {self.n_microbatches}"
            )
        if self._batch_shape not in (None, tuple(tokens.shape)):
            raise ValueError(
                f"pipeline step: batch shape {tuple(tokens.shape)} differs from the first "
                f"step's {self._batch_shape}; stage shapes are fixed"
            )

    def step(self, tokens: torch.Tensor, labels: torch.Tensor) -> float:
        self._check_batch(tokens, labels)
        # contiguous, before the stages are built from it: the batch may be a window of a
        # longer sequence, and torch 2.11's stage checks each microbatch's strides
        # against those of the example input it was built with
        tokens, labels = tokens.contiguous(), labels.contiguous()
        if self._schedule is None:
            self._build_schedule(tokens)
            self._batch_shape = tuple(tokens.shape)
        losses: list[torch.Tensor] = []
        args = (tokens,) if self.has_first else ()
        target = labels if self.has_last else None
        # keyword inputs reach every stage, cut into the same microbatches as ``args``
        token_ids = getattr(self.modules[0], "stages_take_token_ids", False)
        kwargs = {"token_ids": tokens} if token_ids else {}
        self._runs += 1
        # the sends and receives wait as long as the pp group's timeout (the trainer's
        # mesh: parallelism.timeout_s); a stalled neighbour raises a CollectiveError
        what = f"{self.schedule_name} schedule run {self._runs} (sends/receives, loss broadcast)"
        with in_flight(what, f"pipeline stage(s) {self.stage_ids}", {"pp": self.pp_group}):
            self._schedule.step(*args, target=target, losses=losses, return_outputs=False, **kwargs)
            loss = torch.zeros((), dtype=torch.float32, device=tokens.device)
            if self.has_last:
                loss = torch.stack([item.detach().float() for item in losses]).mean()
            last_rank = (self.n_stages - 1) % self.pp_group.size()
            dist.broadcast(loss, group_src=last_rank, group=self.pp_group)
        return float(loss)

    def sent_bytes(self) -> dict[str, int]:
        """Bytes this rank's stages have sent to neighbouring stages so far, forward
        (hidden states) and backward (their gradients); 1 / tp of the whole hidden
        states' under sequence parallelism."""
        return {
            way: sum(stage.sent_bytes[way] for stage in self._stages)
            for way in ("forward", "backward")
        }

    def parameters(self) -> Iterator[nn.Parameter]:
        for module in self.modules:
            yield from module.parameters()


def init_stage_params(
    modules: list[nn.Module], seed: int, init_fn: Callable[[nn.Module], None]
) -> None:
    """``fs.init_params`` for meta-built, sharded stage modules: every rank stores the
    values a single process draws for the whole model after ``torch.manual_seed(seed)``,
    module by module. Modules of other stages consume the random stream on throwaway
    tensors, so each stage continues the stream where the whole model would."""
    from ..models.model import meta_model

    whole = meta_model(modules[0].cfg)
    pending = iter(
        (fqn, sub)
        for fqn, sub in whole.named_modules()
        if next(sub.parameters(False), None) is not None
    )
    device = next(modules[0].parameters()).device

    def draw_until(target: str) -> None:
        for fqn, sub in pending:
            if fqn == target:
                return
            for name, param in list(sub.named_parameters(recurse=False)):  # throwaway draw
                sub._parameters[name] = nn.Parameter(
                    torch.empty(param.shape, dtype=param.dtype, device=device)
                )
            init_fn(sub)
        raise ValueError(f"init_stage_params: module '{target}' is not in the model")

    torch.manual_seed(seed)
    for module in sorted(modules, key=_first_layer):
        names = {id(sub): fqn for fqn, sub in module.named_modules()}

        def init_in_order(sub: nn.Module, names: dict[int, str] = names) -> None:
            draw_until(names[id(sub)])
            init_fn(sub)

        fs.init_params(module, init_in_order)


def _first_layer(module: nn.Module) -> int:
    return min(int(key) for key in module.layers.keys())


def build_pipeline(
    model: nn.Module,
    pp_mesh: DeviceMesh,
    n_microbatches: int,
    schedule: str,
    loss_fn: LossFn,
    shard_fn: Callable[[nn.Module], nn.Module] | None = None,
    virtual_stages: int = 1,
    activation_dtype: torch.dtype = torch.float32,
    sequence_shards: int | None = None,
) -> PipelineRunner:
    """Split ``model`` (consumed) into this rank's stages, shard each with
    ``shard_fn(stage_module)`` (e.g. flexshard over the data-parallel mesh) and return
    the runner. ``activation_dtype``: dtype of the hidden states and logits stages
    exchange (the mixed-precision param dtype when one is set); ``sequence_shards``: how
    many pieces the hidden states' sequence is cut into between stages beyond the
    tokens given to ``step``: the model's (the tp degree after ``apply_tp`` with
    sequence parallelism, else 1), which a value given must equal."""
    if pp_mesh.ndim != 1:
        raise ValueError(f"build_pipeline: pp_mesh must be 1-D, got {pp_mesh.ndim} dims")
    model_shards = getattr(model, "sequence_shards", 1)
    if sequence_shards is None:
        sequence_shards = model_shards
    if isinstance(sequence_shards, bool) or not isinstance(sequence_shards, int):
        raise TypeError(f"build_pipeline: sequence_shards must be an int, got {sequence_shards!r}")
    if sequence_shards < 1:
        raise ValueError(f"build_pipeline: sequence_shards must be >= 1, got {sequence_shards}")
    if sequence_shards != model_shards:
        # the stages would receive into buffers of another shape than the blocks emit
        raise ValueError(
            f"build_pipeline: sequence_shards = {sequence_shards}, but the model's blocks "
            f"emit hidden states cut into {model_shards} sequence shard(s) (apply_tp with "
            "sequence_parallel cuts them into tp)"
        )
    if not isinstance(activation_dtype, torch.dtype) or not activation_dtype.is_floating_point:
        raise TypeError(
            f"build_pipeline: activation_dtype must be a floating torch.dtype, "
            f"got {activation_dtype!r}"
        )
    pp = pp_mesh.size()
    n_stages = pp * virtual_stages
    ids = stage_ids(pp_mesh.get_local_rank(), pp, virtual_stages)
    modules = split_model(model, n_stages, ids)
    if shard_fn is not None:
        modules = [shard_fn(module) for module in modules]
    return PipelineRunner(
        modules,
        ids,
        n_stages,
        pp_mesh,
        n_microbatches,
        schedule,
        loss_fn,
        activation_dtype,
        sequence_shards,
    )
