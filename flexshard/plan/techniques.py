"""What a run does beyond the trainer's config that changes its step time: Float8
linears, asynchronous tensor parallelism, and the activation-checkpoint policy's
matmul recompute (``torch.compile`` is the config's ``[compile] enable``).

- **Float8 linears** (torchao ``convert_to_float8_training``, tensorwise dynamic
  scaling, as torchtitan's ``[float8]`` runs them): the blocks' linears (not the LM
  head, not attention) run their three GEMMs (forward, grad-input, grad-weight) on the
  FP8 tensor cores (``Hardware.fp8_tflops``). Each GEMM operand is scaled first: an
  amax pass (read bf16), then a cast (read bf16, write fp8), and the backward's
  grad-weight / grad-input GEMMs need the fp8 operands transposed (read and write fp8):
  7 bytes per element of the input, the weight and the output gradient eagerly. Under
  ``torch.compile`` the amax is fused into the producer and cast + transpose into one
  pass: 4 bytes per element (read bf16, write fp8 twice). torchao's float8 README
  describes the recipe; the byte counts are this model's reading of it.
- **Async TP** (torchtitan ``enable_async_tensor_parallel``, compile's micro-pipelining
  of each TP all-gather / reduce-scatter with its matmul): the share
  ``Hardware.async_tp_overlap`` of the TP collectives leaves the critical path (the
  decomposed matmuls and the copies' SMs keep the rest).
- **Selective AC by op, torchtitan's policy** (``torchtitan/.../activation_checkpoint.py``:
  "saves output of all compute ops, except every second mm"): half of a block's
  matmuls are recomputed in backward besides its non-GEMM ops; the trainer's own
  policy keeps every matmul (``op_ac_recomputed_mm = 0``).
- **FSDP Float8 all-gather** (torchao ``enable_fsdp_float8_all_gather`` with
  ``precompute_float8_dynamic_scale_for_fsdp``, as torchtitan's Llama 3.1 405B config
  at its performance run's commit 9dec370 and its ``docs/float8.md`` run Float8): each
  linear's weight is cast on its shard once per all-gather (1 / W of the weight: not
  counted), the all-gather moves 1 byte per weight element instead of 2, and a GEMM's
  weight operand arrives scaled: no amax or cast in forward, its transpose for the
  backward (read and write fp8, 2 bytes per element) alone.
- **Loss parallel** (torchtitan's default under TP, ``training.disable_loss_parallel``
  false): the LM head's output stays sharded over the vocabulary and the cross-entropy
  runs on the shards, so the logits, their fp32 copy and their gradient take 1 / tp of
  a rank's memory. The trainer gathers the logits whole on every tp rank (off).
- **Expandable segments** (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, as
  torchtitan's ``run_llama_train.sh`` launched at 9dec370): the caching allocator grows
  one segment per stream by pages instead of caching one segment per large request;
  changes what it reserves, not the step (``allocator.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

#: bytes per element of a Float8 GEMM operand's scaling: eager, compiled
FLOAT8_SCALE_BYTES = {False: 7, True: 4}
#: of those, the forward's (input and weight: amax + cast; the rest is backward's)
FLOAT8_FORWARD_BYTES = {False: 5, True: 3}
#: scaling kernels per operand (amax, scale, cast, transpose), eager and compiled
FLOAT8_SCALE_OPS = {False: 4, True: 1}


@dataclass(frozen=True)
class Techniques:
    float8: bool = False  # Float8 GEMMs in the blocks' linears
    async_tp: bool = False  # TP collectives overlapped with their matmuls
    op_ac_recomputed_mm: float = 0.0  # share of a block's matmuls op-level AC recomputes
    loss_parallel: bool = False  # the LM head's logits and the loss sharded over tp
    # the linears' weights cast to FP8 on their shards before FSDP's all-gather
    float8_all_gather: bool = False
    expandable_segments: bool = False  # the CUDA caching allocator's (memory reserved)

    def __post_init__(self) -> None:
        if self.float8_all_gather and not self.float8:
            raise ValueError("float8_all_gather (--float8-all-gather) needs float8 (--float8)")
        if not 0.0 <= self.op_ac_recomputed_mm <= 1.0:
            raise ValueError(
                f"op_ac_recomputed_mm = {self.op_ac_recomputed_mm}: a share, in [0, 1]"
            )


TRAINER = Techniques()
#: torchtitan's op-level selective AC (every second mm recomputed)
TORCHTITAN_OP_AC = 0.5


#: bytes per weight element a pre-scaled (FP8-gathered) weight moves: its transpose, in backward
FLOAT8_GATHERED_WEIGHT_BYTES = 2


def float8_scale_bytes(
    tokens: int, rows: int, cols: int, compiled: bool, weight_gathered_fp8: bool = False
) -> tuple[float, float]:
    """(forward, backward) bytes one linear ``[rows, cols]`` moves scaling its GEMM
    operands over ``tokens`` tokens: input ``tokens x cols``, weight ``rows x cols``,
    output gradient ``tokens x rows``; ``weight_gathered_fp8``: the weight arrives cast."""
    per = FLOAT8_SCALE_BYTES[compiled]
    forward = FLOAT8_FORWARD_BYTES[compiled]
    x, w, dy = tokens * cols, rows * cols, tokens * rows
    # the input and weight are cast in forward (transposed in backward); the gradient in backward
    if weight_gathered_fp8:
        return forward * x, (per - forward) * x + FLOAT8_GATHERED_WEIGHT_BYTES * w + per * dy
    return forward * (x + w), (per - forward) * (x + w) + per * dy
