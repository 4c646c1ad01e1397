"""The config's own values checked beyond their types, at load: sizes, ranges, what
needs what, the explicit buckets, the data source's keys, the optimizer and the
Hugging Face formats against the layout. Each raises a ConfigError (a ValueError)
naming the keys.

Which Hugging Face architecture a model config maps to, or why none does
(``hf_format``): a check on the config alone, so the start-up validation runs it
without importing the model and the adapter (models/hf_adapter.py).

The checks that belong to a layer above live beside the code they guard, each run
once before any rank starts: every parallelism's in its own module, run together by
``checked_dims`` (parallel/parallelize.py); GRPO's in ``rl/grpo.py``
(``check_rl``); the files and folders a run reads in ``checkpointing/preflight.py``."""

from __future__ import annotations

from typing import Any

from .schema import Config, ConfigError, DataConfig, ModelConfig

HF_OPTIONS = "checkpoint.initial_load_in_hf / last_save_in_hf"


def _deepseek_v3_problems(cfg: ModelConfig) -> list[str]:
    """Why an MLA model has no ``DeepseekV3ForCausalLM`` twin (none: it has)."""
    moe, problems = cfg.moe, []
    if not moe.num_experts:
        return problems
    if moe.score_func != "sigmoid":
        problems.append(
            f'model.moe.score_func = "{moe.score_func}" (DeepSeek-V3 routes by sigmoid '
            'scores): set "sigmoid"'
        )
    if moe.balance != "bias":
        problems.append(
            f'model.moe.balance = "{moe.balance}" (the format holds the selection bias, '
            'e_score_correction_bias): set "bias" (bias_update_rate = 0 keeps it at zero)'
        )
    if not moe.num_shared_experts:
        problems.append("model.moe.num_shared_experts = 0 (DeepSeek-V3 has shared experts)")
    hidden = moe.expert_hidden or cfg.ffn_hidden_size()
    if moe.shared_width(hidden) != hidden * moe.num_shared_experts or moe.shared_expert_gate:
        problems.append(
            "model.moe.shared_expert_hidden / shared_expert_gate (DeepSeek-V3's shared "
            "experts are num_shared_experts ungated experts of expert_hidden): set 0 and false"
        )
    if cfg.tie_embeddings:
        problems.append("model.tie_embeddings = true (DeepSeek-V3's head is its own)")
    return problems


def _qwen3_5_moe_problems(cfg: ModelConfig, export: bool) -> list[str]:
    """Why a gated-attention MoE has no ``Qwen3_5MoeForCausalLM`` twin (none: it has)."""
    moe, problems = cfg.moe, []
    if moe.score_func != "softmax" or moe.n_group > 1 or moe.routed_scaling_factor != 1.0:
        problems.append(
            "model.moe.score_func / n_group / routed_scaling_factor (Qwen3.5-MoE routes by "
            'the softmax over all experts, unscaled): set "softmax", 1 and 1.0'
        )
    if not moe.norm_topk_prob:
        problems.append(
            "model.moe.norm_topk_prob = false (Qwen3.5-MoE renormalises the chosen weights)"
        )
    if moe.num_shared_experts != 1 or not moe.shared_expert_gate:
        problems.append(
            f"model.moe.num_shared_experts = {moe.num_shared_experts}, shared_expert_gate = "
            f"{str(moe.shared_expert_gate).lower()} (Qwen3.5-MoE has one shared expert, "
            "gated by a sigmoid): set 1 and true"
        )
    dense = [i for i in range(cfg.n_layers) if not moe.is_moe_layer(i)]
    if dense:
        problems.append(
            f"layers {dense} are dense (model.moe.first_dense_layers / decoder_sparse_step / "
            "mlp_only_layers): every Qwen3.5-MoE layer is MoE; set 0, 1 and []"
        )
    if export and moe.balance == "bias":
        problems.append(
            'model.moe.balance = "bias" (the learned selection bias picks the experts; '
            "Qwen3.5-MoE routes by the softmax alone and has no tensor for the bias)"
        )
    return problems


def hf_format(cfg: ModelConfig, option: str = HF_OPTIONS, export: bool = False) -> str:
    """The Hugging Face ``model_type`` computing what the model does: ``"llama"`` /
    ``"qwen3"`` (dense, without / with q/k norms), ``"mixtral"`` / ``"qwen3_moe"`` (MoE,
    likewise), ``"deepseek_v3"`` (MLA), ``"qwen3_5_text"`` / ``"qwen3_5_moe_text"``
    (gated attention, dense / MoE); a ConfigError naming ``option`` and every reason
    when the model has no Hugging Face twin. ``export``: the model is written (a
    ``"bias"`` balance changes the routing, and neither MoE format but DeepSeek-V3's has
    a tensor to hold it). Multi-token prediction is exported in DeepSeek-V3's format
    only (its depths as DeepSeek publishes them)."""
    moe = cfg.moe
    if cfg.attention == "deepseek_v4":  # validate() holds it to its one twin
        return "deepseek_v4"
    if cfg.attention == "gated":
        if not moe.num_experts:
            return "qwen3_5_text"
        problems = _qwen3_5_moe_problems(cfg, export)
        if problems:
            raise ConfigError(
                f"{option}: this gated-attention MoE has no Qwen3_5MoeForCausalLM twin: "
                + "; ".join(problems)
            )
        return "qwen3_5_moe_text"
    if cfg.attention == "mla":
        problems = _deepseek_v3_problems(cfg)
        if problems:
            raise ConfigError(
                f"{option}: this MLA model has no DeepseekV3ForCausalLM twin: {'; '.join(problems)}"
            )
        return "deepseek_v3"
    if not moe.num_experts:
        return "qwen3" if cfg.qk_norm else "llama"
    kind = "qwen3_moe" if cfg.qk_norm else "mixtral"
    problems = []
    if moe.score_func != "softmax" or moe.n_group > 1 or moe.routed_scaling_factor != 1.0:
        problems.append(
            "model.moe.score_func / n_group / routed_scaling_factor (Mixtral and Qwen3-MoE "
            'route by the softmax over all experts, unscaled): set "softmax", 1 and 1.0'
        )
    if moe.num_shared_experts:
        problems.append(
            f"model.moe.num_shared_experts = {moe.num_shared_experts} (Mixtral and Qwen3-MoE "
            "have no shared expert; Qwen2-MoE gates its shared expert with a sigmoid, "
            "DeepSeek's come with MLA attention): set 0"
        )
    dense = {
        "first_dense_layers": (moe.first_dense_layers, 0),
        "decoder_sparse_step": (moe.decoder_sparse_step, 1),
        "mlp_only_layers": (moe.mlp_only_layers, []),
    }
    for key, (value, everywhere) in dense.items():
        if kind == "mixtral" and value != everywhere:
            problems.append(
                f"model.moe.{key} = {value} (every Mixtral layer is MoE; Qwen3-MoE, with "
                f"model.qk_norm = true, has dense layers): set {everywhere}"
            )
    if kind == "mixtral" and not moe.norm_topk_prob:
        problems.append(
            "model.moe.norm_topk_prob = false (Mixtral renormalises the chosen weights; "
            "Qwen3-MoE, with model.qk_norm = true, may not): set true"
        )
    if export and moe.balance == "bias":
        problems.append(
            'model.moe.balance = "bias" (the learned selection bias picks the experts; '
            "Mixtral and Qwen3-MoE route by the softmax alone and have no tensor for the bias)"
        )
    if problems:
        raise ConfigError(
            f"{option}: this MoE has no Hugging Face twin (Mixtral and Qwen3-MoE are the "
            f"ones whose routing matches the trainer's): {'; '.join(problems)}"
        )
    return kind


PLACEMENT_NAMES = ("shard0", "flat", "owned", "block", "mixed")


def layout_without_mtp(cfg: Config) -> list[str]:
    """The settings (``key = value``) under which ``cfg``'s run cannot train multi-token
    prediction, empty where it can (data and expert parallelism): tp, pp and cp, which
    ``check_layout`` refuses with ``model.mtp_layers`` (the depths share the embedding and
    the head, which pp puts on different stages, and read tokens ahead, which cp puts on
    other ranks), and rl, which ``check_rl`` refuses (its update is on sampled
    completions)."""
    p = cfg.parallelism
    degrees = {"tp": p.tp, "pp": p.pp, "cp": p.cp}
    without = [f"parallelism.{k} = {v}" for k, v in degrees.items() if v > 1]
    return without + (["rl.enable = true"] if cfg.rl.enable else [])


def _check_bucket_entry(where: str, entry: Any) -> None:
    """One explicit bucket: {patterns = [...], placement = "owned", name = "..", block = [R, C]}."""
    if not isinstance(entry, dict):
        raise ConfigError(f'{where}: a table like {{patterns = ["layers.*"], placement = ..}}')
    unknown = set(entry) - {"patterns", "placement", "name", "block"}
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown)}")
    patterns = entry.get("patterns")
    if isinstance(patterns, str):
        patterns = [patterns]
    if not patterns or not all(isinstance(x, str) for x in patterns):
        raise ConfigError(f"{where}.patterns: a list of FQN glob patterns is required")
    if entry.get("placement", "shard0") not in PLACEMENT_NAMES:
        raise ConfigError(
            f"{where}.placement = {entry['placement']!r}: must be one of {PLACEMENT_NAMES}"
        )
    block = entry.get("block", [1, 1])
    if not (
        isinstance(block, list)
        and len(block) == 2
        and all(isinstance(b, int) for b in block)
        and min(block) >= 1
    ):
        raise ConfigError(f"{where}.block = {block!r}: must be two positive sizes [R, C]")


def _check_mla(m: ModelConfig, optimizer: str) -> None:
    sizes = {
        "model.kv_lora_rank": m.kv_lora_rank,
        "model.qk_nope_head_dim": m.qk_nope_head_dim,
        "model.qk_rope_head_dim": m.qk_rope_head_dim,
        "model.v_head_dim": m.v_head_dim,
    }
    for key, value in sizes.items():
        if value < 1:
            raise ConfigError(f"{key} = {value}: must be at least 1")
    for key, value in (("qk_norm", m.qk_norm), ("head_dim", m.head_dim)):
        if value:
            raise ConfigError(
                f"model.{key} = {value!r}: MLA's heads are sized by qk_nope_head_dim, "
                "qk_rope_head_dim and v_head_dim and have no q/k norms; leave it unset"
            )
    if m.q_lora_rank < 0:
        raise ConfigError(f"model.q_lora_rank = {m.q_lora_rank}: must be >= 0 (0: q_proj)")
    if m.qk_rope_head_dim % 2:
        raise ConfigError(f"model.qk_rope_head_dim = {m.qk_rope_head_dim} must be even for RoPE")
    if optimizer != "adamw" and m.qk_rope_head_dim > m.kv_lora_rank:
        raise ConfigError(
            f"model.qk_rope_head_dim = {m.qk_rope_head_dim} exceeds model.kv_lora_rank = "
            f"{m.kv_lora_rank}: training.optimizer = {optimizer!r} and its placements "
            "split kv_a_proj_with_mqa in blocks of kv_lora_rank rows, the rotated key's "
            "rows the last one"
        )
    r = m.rope_scaling
    if r.type == "yarn" and (r.factor < 1 or r.original_max_position_embeddings < 1):
        raise ConfigError(
            "model.rope_scaling: YaRN needs factor >= 1 and original_max_position_embeddings >= 1"
        )


def _check_routing(m: ModelConfig) -> None:
    """Group-limited routing: equal groups of at least two experts (a group is scored by
    its two best), enough experts in the chosen groups for top_k."""
    moe = m.moe
    per_group = moe.num_experts // max(moe.n_group, 1)
    if moe.n_group < 1 or moe.num_experts % moe.n_group:
        raise ConfigError(
            f"model.moe.n_group = {moe.n_group} must be >= 1 and divide model.moe.num_experts "
            f"= {moe.num_experts}"
        )
    if moe.n_group > 1 and per_group < 2:
        raise ConfigError(
            f"model.moe.n_group = {moe.n_group}: each group needs at least 2 experts "
            "(a group is scored by the sum of its two best)"
        )
    if not 1 <= moe.topk_group <= moe.n_group or moe.topk_group * per_group < moe.top_k:
        raise ConfigError(
            f"model.moe.topk_group = {moe.topk_group}: must be in 1..n_group ({moe.n_group}) "
            f"and its groups must hold top_k = {moe.top_k} experts"
        )
    if moe.routed_scaling_factor <= 0:
        raise ConfigError("model.moe.routed_scaling_factor must be > 0")


_V4_KINDS = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")


def _check_deepseek_v4(cfg: Config) -> None:
    """DeepSeek-V4: its sizes, and the layouts built for it (data parallel on every
    placement, tp, ep, pp, cp, with every optimizer); the rest refused naming the key."""
    m, v4, moe = cfg.model, cfg.model.deepseek_v4, cfg.model.moe
    why = 'model.attention = "deepseek_v4"'
    refused = {
        "compile.enable": (cfg.compile.enable, False),
        "rl.enable": (cfg.rl.enable, False),
        "model.mtp_layers": (m.mtp_layers, 0),
        "model.tie_embeddings": (m.tie_embeddings, False),
        "model.moe.balance": (moe.balance, "bias"),
        "model.moe.score_func": (moe.score_func, "sqrtsoftplus"),
        "model.moe.norm_topk_prob": (moe.norm_topk_prob, True),
        "model.moe.num_shared_experts": (moe.num_shared_experts, 1),
        "model.moe.first_dense_layers": (moe.first_dense_layers, 0),
        "model.n_kv_heads": (m.n_kv_heads, 1),
    }
    for key, (value, ok) in refused.items():
        if value != ok:
            raise ConfigError(f"{key} = {value!r}: {why} needs {ok!r}")
    if len(m.layer_types) != m.n_layers or set(m.layer_types) - set(_V4_KINDS):
        raise ConfigError(f"model.layer_types = {m.layer_types}: one of {_V4_KINDS} per layer")
    kinds = v4.mlp_layer_types
    if len(kinds) != m.n_layers or set(kinds) - {"hash_moe", "moe"}:
        raise ConfigError(
            f"model.deepseek_v4.mlp_layer_types = {kinds}: 'hash_moe' or 'moe' per layer"
        )
    if not 0 < moe.top_k <= moe.num_experts:
        raise ConfigError(f"model.moe.top_k = {moe.top_k}: 1 to num_experts ({moe.num_experts})")
    if m.q_lora_rank < 1 or m.head_dim < 1:
        raise ConfigError(f"model.q_lora_rank and model.head_dim: set both ({why})")
    if m.rotary_dim() % 2 or m.rotary_dim() > min(m.head_dim, v4.index_head_dim):
        raise ConfigError(
            f"model.partial_rotary_factor = {m.partial_rotary_factor}: an even number of "
            f"rotated dims, at most model.deepseek_v4.index_head_dim = {v4.index_head_dim}"
        )
    if (m.n_heads * m.head_dim) % v4.o_groups:
        raise ConfigError(
            f"model.deepseek_v4.o_groups = {v4.o_groups} does not divide the "
            f"{m.n_heads * m.head_dim} head dims"
        )
    sizes = {f"model.deepseek_v4.{k}": v for k, v in vars(v4).items() if k != "mlp_layer_types"}
    small = {k: v for k, v in sizes.items() if v <= 0}
    if small:
        raise ConfigError(f"{', '.join(f'{k} = {v}' for k, v in small.items())}: must be > 0")


def _check_layer_types(m: ModelConfig) -> None:
    """Gated DeltaNet layers: only beside Qwen3.5's gated attention, with whole heads."""
    if not m.layer_types or m.attention == "deepseek_v4":
        return
    kinds = ("full_attention", "linear_attention")
    if len(m.layer_types) != m.n_layers or set(m.layer_types) - set(kinds):
        raise ConfigError(
            f"model.layer_types = {m.layer_types}: one of {kinds} per layer "
            f"(model.n_layers = {m.n_layers})"
        )
    if "linear_attention" in m.layer_types and m.attention != "gated":
        raise ConfigError(
            'model.layer_types has "linear_attention": Gated DeltaNet layers come with '
            'attention = "gated" (Qwen3.5)'
        )
    la = m.linear_attention
    sizes = {f"model.linear_attention.{k}": v for k, v in vars(la).items()}
    small = {k: v for k, v in sizes.items() if v < 1}
    if small:
        raise ConfigError(f"{', '.join(f'{k} = {v}' for k, v in small.items())}: must be >= 1")
    if la.num_value_heads % la.num_key_heads:
        raise ConfigError(
            f"model.linear_attention.num_value_heads = {la.num_value_heads} is not a multiple "
            f"of num_key_heads = {la.num_key_heads}"
        )


def validate(cfg: Config) -> None:
    """Values that type-check but make no sense."""
    m, t, p = cfg.model, cfg.training, cfg.parallelism
    positive = {
        "model.vocab_size": m.vocab_size,
        "model.dim": m.dim,
        "model.n_layers": m.n_layers,
        "model.n_heads": m.n_heads,
        "model.n_kv_heads": m.n_kv_heads,
        "training.steps": t.steps,
        "training.seq_len": t.seq_len,
        "training.batch_size": t.batch_size,
        "training.grad_accum": t.grad_accum,
        "parallelism.dp_replicate": p.dp_replicate,
        "job.log_every": cfg.job.log_every,
        "checkpoint.interval": cfg.checkpoint.interval,
    }
    for key, value in positive.items():
        if value < 1:
            raise ConfigError(f"{key} = {value}: must be at least 1")
    if m.vocab_size < 256 and m.tokenizer == "bytes":
        raise ConfigError(f"model.vocab_size = {m.vocab_size}: the byte tokenizer needs 256")
    v = cfg.validation
    if v.enable and (v.freq < 1 or v.steps < 1 or not 0 < v.fraction < 1):
        raise ConfigError("validation.freq and steps must be >= 1, validation.fraction in (0, 1)")
    if v.enable and p.pp > 1:
        raise ConfigError("validation.enable: not wired with parallelism.pp > 1 yet")
    if cfg.checkpoint.initial_load_in_hf and not cfg.checkpoint.initial_load_path:
        raise ConfigError("checkpoint.initial_load_in_hf needs checkpoint.initial_load_path")
    if not 0 < p.timeout_s < float("inf"):  # also rejects NaN
        raise ConfigError(f"parallelism.timeout_s = {p.timeout_s}: must be a positive number")
    for dim in ("tp", "pp", "cp", "ep", "pp_virtual_stages"):
        if getattr(p, dim) < 1:
            raise ConfigError(f"parallelism.{dim} = {getattr(p, dim)}: must be at least 1")
    if p.pp_microbatches < 0:
        raise ConfigError(f"parallelism.pp_microbatches = {p.pp_microbatches}: must be >= 0")
    if p.dp_shard < 1 and p.dp_shard != -1:
        raise ConfigError(f"parallelism.dp_shard = {p.dp_shard}: must be -1 (auto) or >= 1")
    if m.attention == "mla":
        _check_mla(m, t.optimizer)
    elif m.attention == "deepseek_v4":
        _check_deepseek_v4(cfg)
    else:
        if m.head_dim < 0:
            raise ConfigError(f"model.head_dim = {m.head_dim}: must be >= 0 (0: dim / n_heads)")
        if not m.head_dim and m.dim % m.n_heads:
            raise ConfigError(
                f"model.dim = {m.dim} is not divisible by model.n_heads = {m.n_heads} "
                "(or set model.head_dim)"
            )
        if m.rotary_dim() % 2 or not 0 < m.partial_rotary_factor <= 1:
            raise ConfigError(
                f"model.partial_rotary_factor = {m.partial_rotary_factor} of head dim "
                f"{m.head_size()}: RoPE needs an even number of rotated dims"
            )
        if m.n_heads % m.n_kv_heads:
            raise ConfigError(
                f"model.n_heads = {m.n_heads} is not a multiple of model.n_kv_heads = "
                f"{m.n_kv_heads}"
            )
        if m.rope_scaling.type != "none":
            raise ConfigError(
                f'model.rope_scaling.type = "{m.rope_scaling.type}": YaRN is implemented for '
                'attention = "mla" only'
            )
    _check_layer_types(m)
    if m.mtp_layers < 0 or m.mtp_loss_weight < 0:
        raise ConfigError("model.mtp_layers and model.mtp_loss_weight must be >= 0")
    if m.mtp_layers and t.seq_len < m.mtp_layers + 2:
        raise ConfigError(
            f"training.seq_len = {t.seq_len}: multi-token prediction with model.mtp_layers "
            f"= {m.mtp_layers} needs at least mtp_layers + 2 tokens"
        )
    moe = m.moe
    if moe.num_experts and not 1 <= moe.top_k <= moe.num_experts:
        raise ConfigError(
            f"model.moe.top_k = {moe.top_k}: must be in 1..num_experts ({moe.num_experts})"
        )
    if moe.decoder_sparse_step < 1:
        raise ConfigError(
            f"model.moe.decoder_sparse_step = {moe.decoder_sparse_step}: must be >= 1"
        )
    outside = [i for i in moe.mlp_only_layers if not 0 <= i < m.n_layers]
    if outside:
        raise ConfigError(
            f"model.moe.mlp_only_layers: {outside} not in 0..{m.n_layers - 1} (model.n_layers)"
        )
    if moe.num_experts:
        _check_routing(m)
    if moe.shared_expert_hidden < 0:
        raise ConfigError(
            f"model.moe.shared_expert_hidden = {moe.shared_expert_hidden}: must be >= 0"
        )
    if moe.shared_expert_gate and not moe.num_shared_experts:
        raise ConfigError(
            "model.moe.shared_expert_gate = true with model.moe.num_shared_experts = 0: "
            "there is no shared expert to gate"
        )
    if moe.bias_update_rate < 0 or moe.aux_loss_coef < 0:
        raise ConfigError("model.moe.bias_update_rate and aux_loss_coef must be >= 0")
    if t.lr <= 0 or t.muon_lr <= 0 or not 0 <= t.min_lr_ratio <= 1:
        raise ConfigError("training.lr and muon_lr must be > 0 and training.min_lr_ratio in [0, 1]")
    if t.warmup_steps < 0 or t.max_norm < 0 or t.weight_decay < 0:
        raise ConfigError("training.warmup_steps, max_norm and weight_decay must be >= 0")
    if len(t.betas) != 2:
        raise ConfigError(f"training.betas = {t.betas}: must be two numbers")
    if len(p.block) != 2 or min(p.block) < 1:
        raise ConfigError(f"parallelism.block = {p.block}: must be two positive sizes [R, C]")
    # Muon runs on every layout (DistMuon: tp matrices have one owner per tp group,
    # each pipeline stage its own matrices, experts one matrix each); SOAP/Shampoo's
    # MatrixOptimizer is not wired with pp stages or EP's expert meshes
    if p.tp * p.pp * p.ep > 1 and t.optimizer not in ("adamw", "muon"):
        raise ConfigError(
            f'training.optimizer = "{t.optimizer}" is not wired with tp, pp or ep > 1'
            ' (use "adamw" or "muon")'
        )
    # Hugging Face folders work on every layout; an MoE needs a Mixtral twin (refused
    # here, not after training)
    if cfg.checkpoint.initial_load_in_hf:
        hf_format(m, "checkpoint.initial_load_in_hf")
    if cfg.checkpoint.last_save_in_hf:
        hf_format(m, "checkpoint.last_save_in_hf", export=True)
    for i, entry in enumerate(p.buckets):
        _check_bucket_entry(f"parallelism.buckets[{i}]", entry)
    _check_data_source(cfg.data)


def _check_data_source(d: DataConfig) -> None:
    """Each source has the key it reads; a key no source reads is a mistake, not a
    silent default."""
    if d.source == "files" and not d.paths:
        raise ConfigError('data.source = "files" needs data.paths (text files or globs)')
    if d.source == "hf_disk" and not d.hf_path:
        raise ConfigError('data.source = "hf_disk" needs data.hf_path (a save_to_disk folder)')
    if d.source != "files" and d.paths:
        raise ConfigError(
            f'data.paths is set but data.source = "{d.source}" does not read it: set '
            'data.source = "files" to train on those files, or leave data.paths out'
        )
    if d.source != "hf_disk" and d.hf_path:
        raise ConfigError(
            f'data.hf_path is set but data.source = "{d.source}" does not read it: set '
            'data.source = "hf_disk" to train on that dataset, or leave data.hf_path out'
        )
