"""The config's values checked beyond their types: sizes, ranges, what needs what, the
explicit buckets; the layout checks of the tp / pp / cp / ep degrees are in
``layout_checks`` (one place for each, shared with the parallel pieces)."""

from __future__ import annotations

from typing import Any

from .config_schema import Config, ConfigError
from .layout_checks import check_parallel_layout

PLACEMENT_NAMES = ("shard0", "flat", "owned", "block", "mixed")


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
    if cfg.checkpoint.initial_load_in_hf and not cfg.checkpoint.initial_load_path:
        raise ConfigError("checkpoint.initial_load_in_hf needs checkpoint.initial_load_path")
    if not 0 < p.timeout_s < float("inf"):  # also rejects NaN
        raise ConfigError(f"parallelism.timeout_s = {p.timeout_s}: must be a positive number")
    if p.dp_shard < 1 and p.dp_shard != -1:
        raise ConfigError(f"parallelism.dp_shard = {p.dp_shard}: must be -1 (auto) or >= 1")
    if m.dim % m.n_heads:
        raise ConfigError(f"model.dim = {m.dim} is not divisible by model.n_heads = {m.n_heads}")
    if (m.dim // m.n_heads) % 2:
        raise ConfigError(f"head dim {m.dim // m.n_heads} must be even for RoPE")
    if m.n_heads % m.n_kv_heads:
        raise ConfigError(
            f"model.n_heads = {m.n_heads} is not a multiple of model.n_kv_heads = {m.n_kv_heads}"
        )
    moe = m.moe
    if moe.num_experts and not 1 <= moe.top_k <= moe.num_experts:
        raise ConfigError(
            f"model.moe.top_k = {moe.top_k}: must be in 1..num_experts ({moe.num_experts})"
        )
    if moe.bias_update_rate < 0 or moe.aux_loss_coef < 0:
        raise ConfigError("model.moe.bias_update_rate and aux_loss_coef must be >= 0")
    if t.lr <= 0 or not 0 <= t.min_lr_ratio <= 1:
        raise ConfigError("training.lr must be > 0 and training.min_lr_ratio in [0, 1]")
    if t.warmup_steps < 0 or t.max_norm < 0 or t.weight_decay < 0:
        raise ConfigError("training.warmup_steps, max_norm and weight_decay must be >= 0")
    if len(t.betas) != 2:
        raise ConfigError(f"training.betas = {t.betas}: must be two numbers")
    if len(p.block) != 2 or min(p.block) < 1:
        raise ConfigError(f"parallelism.block = {p.block}: must be two positive sizes [R, C]")
    check_parallel_layout(cfg)
    for i, entry in enumerate(p.buckets):
        _check_bucket_entry(f"parallelism.buckets[{i}]", entry)
    if cfg.data.source == "files" and not cfg.data.paths:
        raise ConfigError('data.source = "files" needs data.paths (text files or globs)')
    if cfg.data.source == "hf_disk" and not cfg.data.hf_path:
        raise ConfigError('data.source = "hf_disk" needs data.hf_path (a save_to_disk folder)')
