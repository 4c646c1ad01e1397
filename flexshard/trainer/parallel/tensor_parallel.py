"""Tensor parallelism for the trainer's Transformer, torchtitan style, on torch DTensor.

``apply_tp`` runs before data parallelism: the projections become DTensor parameters
on the tp mesh (column-wise wq/wk/wv/w1/w3, row-wise wo/w2, vocabulary-sharded
embedding, column-wise output head; MLA: ``_mla_plan``), and flexshard later shards
each DTensor's local tensor over the data-parallel group, handing the modules their
DTensors back after every unshard.

With ``sequence_parallel`` the activations between blocks are split along the
sequence across tp (norms run on their sequence shard, weights replicated), and each
attention / feed-forward gathers the sequence on entry and reduce-scatters it on exit.
They stay split between pipeline stages too: a block's output is the local
``[b, s / tp, d]`` of a Shard(1) DTensor, which is what a stage sends and the next
stage's first norm takes as its sequence shard.

Qwen3.5: the gated attention as the others' (``q_proj`` rows are whole heads, each
head's queries then its gates), and the Gated DeltaNet layers by head
(``_linear_attention_plan``).

DeepSeek-V4 (``_deepseek_v4_plan``): its attention by query head (``wq_b`` rows and
the sinks, ``wo_a`` by output group, ``wo_b`` row-wise), the shared key-and-value
head, the compressors and the indexer replicated; the hyper-connections act per token,
on the sequence shards under sequence parallelism (their weights replicated, their
gradients summed over tp, ``hyper_connections.summed_over``); its MoE as the others'.

MoE layers keep the router and the experts replicated over tp: every tp rank routes
the whole sequence and runs every expert on it (the work is duplicated over tp; expert
parallelism is the axis that splits experts). Their gradients come out identical on
every tp rank, so no tp reduction is needed.

DTensor's collectives run on the tp mesh's group and wait as long as its timeout: the
trainer makes that group with ``parallelism.timeout_s`` (``ParallelDims.build_mesh``)
and names the step in the error (``bounded_waits.step_in_flight``).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from ..config import ConfigError, ModelConfig
from ..models.compressed_attention import CompressedAttention
from ..models.deepseek_v4 import DeepseekV4Transformer, V4Block
from ..models.gated_attention import GatedAttention
from ..models.linear_attention import GatedDeltaNet
from ..models.mla import MLA
from ..models.model import Attention, FeedForward, MoE, Transformer


def _block_plan(block: nn.Module, sequence_parallel: bool) -> dict[str, object]:
    """The parallel style of each part of one TransformerBlock."""
    split = Shard(1) if sequence_parallel else Replicate()  # layout between the parts
    norm = SequenceParallel() if sequence_parallel else None
    gather_input = PrepareModuleInput(
        input_layouts=(split, None, None),
        desired_input_layouts=(Replicate(), None, None),
    )
    plan: dict[str, object] = {"attention": gather_input}
    if isinstance(block.attention, MLA):
        plan.update(_mla_plan(block.attention, split))
    elif isinstance(block.attention, GatedDeltaNet):
        plan.update(_linear_attention_plan(split))
    elif isinstance(block.attention, GatedAttention):
        plan["attention.q_proj"] = ColwiseParallel()
        plan["attention.k_proj"] = ColwiseParallel()
        plan["attention.v_proj"] = ColwiseParallel()
        plan["attention.o_proj"] = RowwiseParallel(output_layouts=split)
    else:
        plan["attention.wq"] = ColwiseParallel()
        plan["attention.wk"] = ColwiseParallel()
        plan["attention.wv"] = ColwiseParallel()
        plan["attention.wo"] = RowwiseParallel(output_layouts=split)
    if getattr(block.attention, "q_norm", None) is not None:
        # q / k norms run on this rank's heads ([b, s, heads, head_dim], heads split):
        # weights replicated, their gradients summed over tp
        plan["attention.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan["attention.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    if norm is not None:
        plan["attention_norm"] = norm
        plan["ffn_norm"] = SequenceParallel()
    ffn = block.feed_forward
    ffn_input = PrepareModuleInput(input_layouts=(split,), desired_input_layouts=(Replicate(),))
    if isinstance(ffn, FeedForward):
        plan["feed_forward"] = ffn_input
        plan["feed_forward.w1"] = ColwiseParallel()
        plan["feed_forward.w3"] = ColwiseParallel()
        plan["feed_forward.w2"] = RowwiseParallel(output_layouts=split)
    elif isinstance(ffn, MoE):
        plan["feed_forward"] = _replicated_moe(split)
    return plan


def _replicated_moe(split: Shard | Replicate, *rest: None) -> PrepareModuleInputOutput:
    """Replicated experts: gather the sequence in, hand back this rank's part out;
    ``rest``: the module's other inputs, passed as they are."""
    return PrepareModuleInputOutput(
        input_layouts=(split, *rest),
        desired_input_layouts=(Replicate(), *rest),
        use_local_input=True,
        output_layouts=(Replicate(),),
        desired_output_layouts=(split,),
    )


def _deepseek_v4_plan(sequence_parallel: bool) -> dict[str, object]:
    """One DeepSeek-V4 block: the attention takes the whole sequence as a plain tensor
    (its replicated projections, compressors and indexer read it), its heads'
    ``wq_b`` rows column-wise and ``wo_b`` row-wise (``shard_compressed_attention``
    the rest); the MoE (which also reads the token ids, whole on every rank) replicated.
    The hyper-connections between them run on what the norms see: the sequence shard
    under sequence parallelism."""
    split = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, object] = {
        "attn": PrepareModuleInput(
            input_layouts=(split, None),
            desired_input_layouts=(Replicate(), None),
            use_local_output=True,
        ),
        "attn.wq_b": ColwiseParallel(),
        "attn.wo_b": RowwiseParallel(output_layouts=split),
        "ffn": _replicated_moe(split, None),
    }
    if sequence_parallel:
        plan["attn_norm"] = SequenceParallel()
        plan["ffn_norm"] = SequenceParallel()
    return plan


def shard_compressed_attention(attention: CompressedAttention, tp_mesh: DeviceMesh) -> None:
    """The sinks by head and ``wo_a`` by output group (its rows are group-major, and
    ``check_tp`` keeps each rank's heads whole groups); this rank's heads and groups."""
    tp = tp_mesh.size()
    for module, name in ((attention, "attn_sink"), (attention.wo_a, "weight")):
        param = getattr(module, name)
        sharded = distribute_tensor(param.data, tp_mesh, [Shard(0)])
        module.register_parameter(name, nn.Parameter(sharded, param.requires_grad))
    attention.n_heads //= tp
    attention.groups //= tp
    attention.tp_mesh = tp_mesh


def _mla_plan(attention: MLA, split: Shard | Replicate) -> dict[str, object]:
    """MLA by heads: the projections out of the latents (``q_b_proj`` or ``q_proj``,
    ``kv_b_proj``) column-wise, whole heads per rank, and ``o_proj`` row-wise. The
    low-rank ``q_a_proj`` / ``kv_a_proj_with_mqa`` and their norms stay replicated: they
    are small (rank x dim) and every head needs their whole output (the latents feed
    every head's rows of the b projections, the rotated key is shared by all heads), so
    splitting them would only add a gather. The rotated key's gradient is summed over
    tp in backward (``MLA.tp_mesh``), since each rank's heads give their part of it."""
    q = "attention.q_proj" if attention.q_proj is not None else "attention.q_b_proj"
    return {
        # the whole sequence in as a plain tensor: the replicated a projections take it
        "attention": PrepareModuleInput(
            input_layouts=(split, None, None),
            desired_input_layouts=(Replicate(), None, None),
            use_local_output=True,
        ),
        q: ColwiseParallel(),
        "attention.kv_b_proj": ColwiseParallel(),
        "attention.o_proj": RowwiseParallel(output_layouts=split),
    }


def _linear_attention_plan(split: Shard | Replicate) -> dict[str, object]:
    """Gated DeltaNet by head: z, b and a column-wise (their rows are head-major),
    ``out_proj`` row-wise; ``in_proj_qkv`` column-wise too, its contiguous channel share
    matching the conv's (``shard_linear_attention``), the layer gathering the conv's
    output to slice its heads. The layer takes the whole sequence replicated."""
    return {
        "attention.in_proj_qkv": ColwiseParallel(),
        "attention.in_proj_z": ColwiseParallel(),
        "attention.in_proj_b": ColwiseParallel(),
        "attention.in_proj_a": ColwiseParallel(),
        "attention.out_proj": RowwiseParallel(output_layouts=split),
    }


def shard_linear_attention(attention: GatedDeltaNet, tp_mesh: DeviceMesh) -> None:
    """The Gated DeltaNet parameters no parallel style covers: the conv's channels as
    ``in_proj_qkv``'s rows (Shard(0)), ``A_log`` and ``dt_bias`` by value head, and the
    gated norm's weight (shared by every head) replicated, its gradient summed over tp."""
    layouts = {
        (attention.conv1d, "weight"): Shard(0),
        (attention, "A_log"): Shard(0),
        (attention, "dt_bias"): Shard(0),
        (attention.norm, "weight"): Replicate(),
    }
    for (module, name), placement in layouts.items():
        param = getattr(module, name)
        sharded = distribute_tensor(param.data, tp_mesh, [placement])
        module.register_parameter(name, nn.Parameter(sharded, param.requires_grad))
    attention.tp_mesh = attention.norm.tp_mesh = tp_mesh


def check_tp(cfg: ModelConfig, tp: int) -> None:
    """Every tp rank must hold whole attention heads (MLA: no kv heads of its own;
    Gated DeltaNet: whole key heads and the value heads they serve; DeepSeek-V4: whole
    output groups too); run once, before any rank starts, by ``checked_dims``."""
    parts = [("n_heads", cfg.n_heads, "attention heads")]
    if cfg.attention in ("gqa", "gated"):
        parts.append(("n_kv_heads", cfg.n_kv_heads, "key/value heads"))
    if cfg.attention == "deepseek_v4":
        parts.append(("deepseek_v4.o_groups", cfg.deepseek_v4.o_groups, "output groups"))
    if "linear_attention" in cfg.layer_types:
        la = cfg.linear_attention
        parts.append(("linear_attention.num_key_heads", la.num_key_heads, "Gated DeltaNet heads"))
        parts.append(
            ("linear_attention.num_value_heads", la.num_value_heads, "Gated DeltaNet heads")
        )
    every = " and ".join(f"model.{key} = {heads}" for key, heads, _ in parts)
    for key, heads, kind in parts:
        if heads % tp:
            raise ConfigError(
                f"model.{key} = {heads} is not divisible by parallelism.tp = {tp}; "
                f"parallelism.tp = {tp} must divide {every}: tensor parallelism gives "
                f"every tp rank whole {kind}"
            )


def apply_tp(
    model: Transformer | DeepseekV4Transformer, tp_mesh: DeviceMesh, sequence_parallel: bool = True
) -> None:
    """Tensor-parallelise ``model`` in place over the 1-D ``tp_mesh`` (before any data
    parallelism). Attention modules then work on their local heads."""
    if tp_mesh.ndim != 1:
        raise ValueError(f"apply_tp takes a 1-D tp mesh, got {tp_mesh.ndim}-D")
    tp = tp_mesh.size()
    split = Shard(1) if sequence_parallel else Replicate()
    outer: dict[str, object] = {
        # vocabulary rows split over tp; the partial sums land sequence-split (SP)
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=split),
        # logits gathered whole: the loss is the single process's
        "output": ColwiseParallel(input_layouts=split, output_layouts=Replicate()),
    }
    if sequence_parallel:
        outer["norm"] = SequenceParallel()
    parallelize_module(model, tp_mesh, outer)  # type: ignore[arg-type]
    if model.cfg.tie_embeddings:
        # both are vocabulary-row shards (Shard(0)) of one table: keep one parameter
        model.output.weight = model.tok_embeddings.weight
    # the embedding hands its output over sequence-split (SP): later pipeline stages
    # then receive [b, s / tp, d] and must know the sequence is tp times longer
    model.sequence_shards = tp if sequence_parallel else 1
    if isinstance(model, DeepseekV4Transformer):
        _apply_tp_deepseek_v4(model, tp_mesh, sequence_parallel)
        return
    for block in model.layers:
        parallelize_module(block, tp_mesh, _block_plan(block, sequence_parallel))  # type: ignore[arg-type]
        attention = block.attention
        if isinstance(attention, GatedDeltaNet):
            shard_linear_attention(attention, tp_mesh)
            continue
        attention.n_heads //= tp  # the projections now give this rank's heads only
        if isinstance(attention, MLA):
            attention.tp_mesh = tp_mesh
        else:
            assert isinstance(attention, (Attention, GatedAttention))
            attention.n_kv_heads //= tp


def _apply_tp_deepseek_v4(
    model: DeepseekV4Transformer, tp_mesh: DeviceMesh, sequence_parallel: bool
) -> None:
    """Each block by ``_deepseek_v4_plan``; under sequence parallelism the
    hyper-connections' gradients summed over tp (each rank mixes its own tokens)."""
    for block in model.layers:
        assert isinstance(block, V4Block)
        parallelize_module(block, tp_mesh, _deepseek_v4_plan(sequence_parallel))  # type: ignore[arg-type]
        shard_compressed_attention(block.attn, tp_mesh)
        if sequence_parallel:
            block.hc.tp_mesh = tp_mesh
    if sequence_parallel:
        model.hc_head.tp_mesh = tp_mesh
