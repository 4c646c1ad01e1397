"""The trainer's configuration types: a dataclass per TOML section and ConfigError.

The checks (``validation``) and the tokenizer import these types from here; users import
them from ``flexshard.trainer.config``, which re-exports them.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal


class ConfigError(ValueError):
    """A bad config file, key or value; the message names the key."""


@dataclass
class MoEConfig:
    num_experts: int = 0  # 0: dense SwiGLU feed-forward everywhere
    top_k: int = 2
    num_shared_experts: int = 1
    expert_hidden: int = 0  # 0: the dense ffn_hidden
    # the shared experts' SwiGLU width; 0: expert_hidden * num_shared_experts
    shared_expert_hidden: int = 0
    # Qwen3.5-MoE's shared expert: its output scaled per token by sigmoid(x . w), w a
    # learned [1, dim] row (shared_gate.weight)
    shared_expert_gate: bool = False
    first_dense_layers: int = 1  # DeepSeek keeps the first layer(s) dense
    router_bias: bool = False
    # load balancing (trainer/models/moe.py): "bias" = DeepSeek-V3's aux-loss-free bias
    # (bias += bias_update_rate * sign(mean load - load) after each step), "aux" = an
    # auxiliary loss aux_loss_coef * E * sum(f * P)
    balance: Literal["none", "bias", "aux"] = "none"
    bias_update_rate: float = 1e-3
    aux_loss_coef: float = 1e-2
    # the chosen experts' softmax weights rescaled to sum 1 (Mixtral; Qwen3-MoE's
    # norm_topk_prob), else used as they are
    norm_topk_prob: bool = True
    # DeepSeek-V3's router (trainer/models/moe.py): sigmoid scores; the experts in
    # n_group groups, a token's top-k taken from its topk_group best groups (a group
    # scored by the sum of its two best biased scores); the routed output scaled by
    # routed_scaling_factor
    # "sqrtsoftplus": DeepSeek-V4's sqrt(softplus(logit)) scores
    score_func: Literal["softmax", "sigmoid", "sqrtsoftplus"] = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # Qwen3-MoE's choice of MoE layers: every decoder_sparse_step-th layer (layer i when
    # (i + 1) % step == 0) except those in mlp_only_layers, which stay dense
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)

    def shared_width(self, expert_hidden: int) -> int:
        """The shared experts' SwiGLU width (0: none), experts of ``expert_hidden``."""
        if not self.num_shared_experts:
            return 0
        return self.shared_expert_hidden or expert_hidden * self.num_shared_experts

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block ``layer`` (from 0) has the routed experts, else a dense SwiGLU."""
        return (
            self.num_experts > 0
            and layer >= self.first_dense_layers
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )


@dataclass
class RopeScalingConfig:
    """YaRN's RoPE scaling (trainer/models/mla.py), as Hugging Face's ``rope_scaling``."""

    type: Literal["none", "yarn"] = "none"
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0  # > 0: the softmax scale gains mscale(factor, this)^2


@dataclass
class LinearAttentionConfig:
    """Qwen3.5's Gated DeltaNet layers (trainer/models/linear_attention.py): queries and
    keys of num_key_heads x key_head_dim, values of num_value_heads x value_head_dim
    (each key head serving num_value_heads / num_key_heads value heads), all three
    through a causal depthwise convolution of conv_kernel taps."""

    conv_kernel: int = 4
    key_head_dim: int = 128
    value_head_dim: int = 128
    num_key_heads: int = 16
    num_value_heads: int = 32


@dataclass
class DeepseekV4Config:
    """DeepSeek-V4's own sizes (trainer/models/deepseek_v4.py): hc_mult residual streams
    mixed by Sinkhorn-normalised hyper-connections; per layer (``model.layer_types``)
    sliding-window attention with per-head sinks, plus a compressor of compress_rate_csa
    tokens per entry whose entries a lightning indexer (index_n_heads x index_head_dim)
    picks index_topk of, or one of compress_rate_hca tokens per entry attended whole;
    the compressed branches rotate with compress_rope_theta and ``model.rope_scaling``;
    the heads' output through o_groups low-rank (o_lora_rank) projections; per layer
    (mlp_layer_types) experts chosen by a frozen token -> experts table ("hash_moe") or
    by the router ("moe"); every SwiGLU's gate and up clamped at swiglu_limit."""

    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    sliding_window: int = 128
    o_groups: int = 8
    o_lora_rank: int = 1024
    compress_rate_csa: int = 4
    compress_rate_hca: int = 128
    compress_rope_theta: float = 160000.0
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    swiglu_limit: float = 10.0
    mlp_layer_types: list[str] = field(default_factory=list)


@dataclass
class ModelConfig:
    # the byte tokenizer's 256; left out with a tokenizer file: its ids, padded up to
    # vocab_multiple (a tokenizer.json of 32,000 ids and 64: 32,000)
    vocab_size: int = 256
    vocab_multiple: int = 64
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2  # grouped-query attention: n_heads % n_kv_heads == 0
    head_dim: int = 0  # 0: dim // n_heads; else q/k/v/o are sized n_heads * head_dim
    qk_norm: bool = False  # RMSNorm of each query and key head before RoPE (Qwen3)
    tie_embeddings: bool = False  # the output projection is the embedding table
    ffn_hidden: int = 0  # 0: Llama's rule, 8/3 * dim rounded up to ffn_multiple
    ffn_multiple: int = 16
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    # "bytes", a Hugging Face tokenizer.json or a tiktoken BPE file (tokenizer.py)
    tokenizer: str = "bytes"
    moe: MoEConfig = field(default_factory=MoEConfig)
    # "mla": DeepSeek's multi-head latent attention (trainer/models/mla.py); its keys
    # and values come from a kv_lora_rank latent, its queries from a q_lora_rank one
    # (0: a plain q_proj), each head with qk_nope_head_dim + qk_rope_head_dim query/key
    # dims (only the second part rotated) and v_head_dim value dims; n_kv_heads unused
    # "gated": Qwen3.5's attention (trainer/models/gated_attention.py): q_proj gives each
    # head its queries and a sigmoid output gate, q/k norms, RoPE on the first
    # partial_rotary_factor of each head (Hugging Face's halves layout), and every
    # RMSNorm of the model but Gated DeltaNet's scales by (1 + weight)
    # "deepseek_v4": DeepSeek-V4's shared-KV attention with compressed branches and
    # hyper-connections (``deepseek_v4`` below; layer_types per layer "sliding_attention",
    # "compressed_sparse_attention" or "heavily_compressed_attention")
    attention: Literal["gqa", "mla", "gated", "deepseek_v4"] = "gqa"
    partial_rotary_factor: float = 1.0
    # per layer "full_attention" or "linear_attention" (Gated DeltaNet, with
    # attention = "gated" only); empty: every layer full attention
    layer_types: list[str] = field(default_factory=list)
    linear_attention: LinearAttentionConfig = field(default_factory=LinearAttentionConfig)
    deepseek_v4: DeepseekV4Config = field(default_factory=DeepseekV4Config)
    q_lora_rank: int = 0
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)
    # multi-token prediction (trainer/models/mtp.py): mtp_layers extra depths, each
    # predicting one token further; their mean loss weighted by mtp_loss_weight
    mtp_layers: int = 0
    mtp_loss_weight: float = 0.3

    def is_linear_attention(self, layer: int) -> bool:
        """Whether block ``layer`` (from 0) is a Gated DeltaNet layer."""
        kinds = self.layer_types
        return layer < len(kinds) and kinds[layer] == "linear_attention"

    def rotary_dim(self) -> int:
        """How many of each head's dims RoPE rotates (Qwen3.5: a quarter)."""
        return int(self.head_size() * self.partial_rotary_factor)

    def head_size(self) -> int:
        """Each attention head's width: ``head_dim``, else the model width split by heads."""
        return self.head_dim or self.dim // self.n_heads

    def ffn_hidden_size(self) -> int:
        """The dense SwiGLU's width: ``ffn_hidden``, else 8/3 of ``dim`` rounded up to
        ``ffn_multiple`` (the 4*dim MLP's parameter count)."""
        if self.ffn_hidden:
            return self.ffn_hidden
        return self.ffn_multiple * math.ceil(int(8 * self.dim / 3) / self.ffn_multiple)


@dataclass
class ParallelismConfig:
    dp_replicate: int = 1
    dp_shard: int = -1  # -1: whatever the world size leaves
    dp_backend: Literal["flexshard", "fsdp2"] = "flexshard"
    tp: int = 1  # tensor parallel (innermost)
    pp: int = 1  # pipeline stages (outermost)
    cp: int = 1  # context parallel: every sequence split in 2 * cp zig-zag chunks
    # "allgather": K/V all-gathered (O(seq) per rank); "ring": K/V blocks passed around
    cp_method: Literal["allgather", "ring"] = "allgather"
    ep: int = 1  # expert parallel, borrowed from the dp_shard * cp ranks
    sequence_parallel: bool = True  # with tp > 1: norms and stage sends on sequence shards
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = "1f1b"
    pp_microbatches: int = 0  # 0: pp (one microbatch per stage)
    pp_virtual_stages: int = 1  # stages per pipeline rank (interleaved_1f1b)
    # flexshard buckets: one per block plus one outer bucket, all with this placement;
    # "auto": "muon" under Muon, SOAP or Shampoo on the flexshard backend (matrices whole
    # on balanced owners: the optimizer's step moves no byte), else "shard0"
    placement: Literal["auto", "shard0", "flat", "owned", "block", "mixed", "muon"] = "auto"
    block: list[int] = field(default_factory=lambda: [16, 16])  # BlockShard tile (R, C)
    reshard_after_forward: bool = True
    # explicit buckets replace the defaults: [{patterns=[..], placement="owned", name=".."}]
    buckets: list[dict[str, Any]] = field(default_factory=list)
    # seconds any one collective may wait (flexshard's buckets, clipping, EP / CP
    # exchanges, checkpoint I/O) before it raises a CollectiveError naming it
    timeout_s: float = 300.0


@dataclass
class TrainingConfig:
    steps: int = 20
    seed: int = 0
    seq_len: int = 64
    batch_size: int = 4  # sequences per data-parallel rank per micro-batch
    grad_accum: int = 1  # micro-batches per step
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # decay ends at lr * min_lr_ratio
    warmup_steps: int = 2
    decay: Literal["cosine", "linear", "none"] = "cosine"
    weight_decay: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    # soap/shampoo: pytorch-optimizer's, on every parameter through MatrixOptimizer
    optimizer: Literal["adamw", "muon", "soap", "shampoo"] = "adamw"
    # Muon's rate for the hidden matrices (lr: AdamW's, for the rest): of a sweep on the
    # debug configs, the one that beats AdamW at every lr tried on both (docs/muon.md)
    muon_lr: float = 6e-2
    max_norm: float = 1.0  # 0: no clipping (the norm is still measured)
    mixed_precision: Literal["fp32", "bf16"] = "fp32"
    device: Literal["auto", "cpu", "cuda"] = "auto"


@dataclass
class DataConfig:
    # "rl_task": the [rl] task's prompts with their answers (pre-training for RL)
    source: Literal["builtin", "files", "hf_disk", "rl_task"] = "builtin"
    paths: list[str] = field(default_factory=list)  # text files or globs (source="files")
    hf_path: str = ""  # datasets.save_to_disk folder (source="hf_disk")
    hf_split: str = "train"
    hf_text_field: str = "text"


@dataclass
class JobConfig:
    dump_folder: str = "outputs/debug"
    description: str = ""
    log_every: int = 1
    progress: bool = True  # rank-0 progress bar on stderr
    tensorboard: bool = True  # only if the tensorboard package is importable
    plot: bool = True  # loss-curve PNG at the end (needs matplotlib)
    peak_tflops: float = 0.0  # per rank, for MFU; 0: known GPU table or a CPU matmul probe


@dataclass
class CheckpointConfig:
    enable: bool = False
    interval: int = 10  # steps between saves
    folder: str = "checkpoint"  # under dump_folder
    resume: bool = True  # continue from the latest checkpoint in folder, if any
    export_safetensors: bool = False  # final model, trainer names: dump_folder/model.safetensors
    initial_load_path: str = ""  # start (when not resuming) from this DCP or HF folder
    initial_load_in_hf: bool = False  # initial_load_path is a Hugging Face model folder
    last_save_in_hf: bool = False  # final model as a Hugging Face folder, dump_folder/hf
    export_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # "async": stage to host memory, write in the background while training goes on;
    # "async_with_pinned_mem": the same with staging buffers kept (pinned where CUDA is)
    async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
    keep_latest_k: int = 0  # complete checkpoints kept, older ones deleted; 0: keep all
    # how resume and initial_load_path read the chunks: "dcp", each rank all it needs;
    # "striped", each chunk once, by one rank that needs it, sent to the others
    reads: Literal["dcp", "striped"] = "dcp"

    def __setattr__(self, name: str, value: Any) -> None:
        # the loader sets each key after its type check: ranges are checked here
        if name == "keep_latest_k" and isinstance(value, int) and value < 0:
            raise ConfigError(
                f"checkpoint.keep_latest_k = {value}: must be >= 0 (0 keeps every checkpoint)"
            )
        super().__setattr__(name, value)


@dataclass
class ValidationConfig:
    enable: bool = False
    freq: int = 10  # steps between validations (and after the last step)
    steps: int = 4  # batches per validation
    fraction: float = 0.1  # the end of the text held out for validation


@dataclass
class CompileConfig:
    enable: bool = False  # torch.compile each transformer block (torchtitan's spelling)
    backend: Literal["inductor", "aot_eager", "eager"] = "inductor"


@dataclass
class ActivationCheckpointConfig:
    # recompute in backward instead of keeping activations (torchtitan's spelling):
    # "full" recomputes every block, "selective" per selective_ac_option
    mode: Literal["none", "full", "selective"] = "none"
    # "op": keep matmul outputs, recompute the rest; "n": recompute every n-th block
    selective_ac_option: str = "op"


@dataclass
class RLConfig:
    """On-policy GRPO (trainer/rl): the model generates, a verifier scores, the same
    model is updated; training.steps counts RL steps, training.seq_len is the context."""

    enable: bool = False
    task: Literal["sort"] = "sort"  # sort a few letters (rl/task.py)
    task_min_len: int = 3  # letters per prompt
    task_max_len: int = 6
    prompts_per_step: int = 8  # global, split over the data-parallel ranks
    group_size: int = 8  # completions sampled per prompt (G)
    max_new_tokens: int = 12
    temperature: float = 1.0
    clip_low: float = 0.2  # ratio clipped to [1 - clip_low, 1 + clip_high] (DAPO)
    clip_high: float = 0.28
    kl_coef: float = 0.0  # > 0: k3 KL to a frozen copy of the starting weights
    micro_batch: int = 0  # completions per training forward; 0: a rank's all at once
    # generator's log-probs bit for bit the trainer's (rl/batch_invariant.py)
    batch_invariant: bool = False


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    job: JobConfig = field(default_factory=JobConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    activation_checkpoint: ActivationCheckpointConfig = field(
        default_factory=ActivationCheckpointConfig
    )
    rl: RLConfig = field(default_factory=RLConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
