"""The trainer's configuration: dataclasses per TOML section, loaded from a file and
overridden from the command line (``--training.steps 20``), with clear errors."""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal


class ConfigError(ValueError):
    """A bad config file, key or value; the message names the key."""


@dataclass
class MoEConfig:
    num_experts: int = 0  # 0: dense SwiGLU feed-forward everywhere
    top_k: int = 2
    num_shared_experts: int = 1
    expert_hidden: int = 0  # 0: the dense ffn_hidden
    first_dense_layers: int = 1  # DeepSeek keeps the first layer(s) dense
    router_bias: bool = False
    # load balancing (moe_balance.py): "bias" = DeepSeek-V3's aux-loss-free bias
    # (bias += bias_update_rate * sign(mean load - load) after each step), "aux" = an
    # auxiliary loss aux_loss_coef * E * sum(f * P)
    balance: Literal["none", "bias", "aux"] = "none"
    bias_update_rate: float = 1e-3
    aux_loss_coef: float = 1e-2


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
    ffn_hidden: int = 0  # 0: Llama's rule, 8/3 * dim rounded up to ffn_multiple
    ffn_multiple: int = 16
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    # "bytes", a Hugging Face tokenizer.json or a tiktoken BPE file (tokenizer.py)
    tokenizer: str = "bytes"
    moe: MoEConfig = field(default_factory=MoEConfig)


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
    # flexshard buckets: one per block plus one outer bucket, all with this placement
    placement: Literal["shard0", "flat", "owned", "block", "mixed", "muon"] = "shard0"
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
    max_norm: float = 1.0  # 0: no clipping (the norm is still measured)
    mixed_precision: Literal["fp32", "bf16"] = "fp32"
    device: Literal["auto", "cpu", "cuda"] = "auto"


@dataclass
class DataConfig:
    source: Literal["builtin", "files", "hf_disk"] = "builtin"
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
    export_safetensors: bool = False  # final model as model.safetensors in dump_folder
    initial_load_path: str = ""  # start (when not resuming) from this DCP or HF folder
    initial_load_in_hf: bool = False  # initial_load_path is a Hugging Face model folder
    last_save_in_hf: bool = False  # final model as a Hugging Face folder, dump_folder/hf
    export_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # "async": stage to host memory, write in the background while training goes on;
    # "async_with_pinned_mem": the same with staging buffers kept (pinned where CUDA is)
    async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
    keep_latest_k: int = 0  # complete checkpoints kept, older ones deleted; 0: keep all

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

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _check_type(key: str, value: Any, hint: Any) -> Any:
    """``value`` converted to ``hint`` (int -> float and int -> str allowed: the command
    line reads ``--activation_checkpoint.selective_ac_option 2`` as an int), or a ConfigError."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        choices = typing.get_args(hint)
        if value not in choices:
            raise ConfigError(f"{key} = {value!r}: must be one of {', '.join(map(repr, choices))}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key} = {value!r}: must be a list")
        (item,) = typing.get_args(hint)
        return [_check_type(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
    if origin is dict or hint is Any:
        return value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is str and isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if (hint is int and isinstance(value, bool)) or not isinstance(value, hint):
        raise ConfigError(f"{key} = {value!r}: must be {hint.__name__}")
    return value


def _fill(obj: Any, table: dict[str, Any], prefix: str) -> None:
    hints = typing.get_type_hints(type(obj))
    names = {f.name for f in dataclasses.fields(obj)}
    for key, value in table.items():
        path = f"{prefix}{key}"
        if key not in names:
            raise ConfigError(
                f"unknown config key '{path}'; [{prefix.rstrip('.') or 'top level'}] has: "
                f"{', '.join(sorted(names))}"
            )
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"'{path}' is a section; write it as [{path}]")
            _fill(current, value, f"{path}.")
        else:
            setattr(obj, key, _check_type(path, value, hints[key]))


def _parse_value(text: str) -> Any:
    """A command-line value as TOML would read it (20, 3e-4, true, [16, 16]); else a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _set_dotted(table: dict[str, Any], dotted: str, value: Any) -> None:
    *sections, key = dotted.split(".")
    for section in sections:
        table = table.setdefault(section, {})
        if not isinstance(table, dict):
            raise ConfigError(f"--{dotted}: '{section}' is not a section")
    table[key] = value


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """``["--training.steps", "20", "--job.dump_folder=out"]`` -> a nested table."""
    table: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(f"expected an override like --training.steps 20, got '{arg}'")
        if "=" in arg:
            dotted, text = arg[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"override '{arg}' has no value")
            dotted, text = arg[2:], args[i + 1]
            i += 2
        _set_dotted(table, dotted, _parse_value(text))
    return table


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults, then the TOML file, then ``--section.key value`` overrides; validated."""
    table: dict[str, Any] = {}
    if path is not None:
        try:
            table = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file '{path}' not found") from None
        except IsADirectoryError:
            raise ConfigError(f"--config '{path}' is a folder; give a .toml file") from None
        except (OSError, UnicodeDecodeError) as err:  # unreadable, or not text
            raise ConfigError(f"config file '{path}': {err}") from None
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"config file '{path}': {err}") from None
    table = _merge(table, parse_overrides(overrides or []))
    cfg = Config()
    _fill(cfg, table, "")
    _vocab_from_tokenizer(cfg, table)
    _check_activation_checkpoint(cfg.activation_checkpoint)
    from .config_validation import validate  # it imports this module

    validate(cfg)
    return cfg


def config_from_dict(table: dict[str, Any]) -> Config:
    """A Config from a nested dict (as ``Config.to_dict`` gives), validated."""
    cfg = Config()
    _fill(cfg, table, "")
    _vocab_from_tokenizer(cfg, table)
    _check_activation_checkpoint(cfg.activation_checkpoint)
    from .config_validation import validate  # it imports this module

    validate(cfg)
    return cfg


def _vocab_from_tokenizer(cfg: Config, table: dict[str, Any]) -> None:
    """A tokenizer file and no ``model.vocab_size``: the tokenizer's ids, padded up to
    ``model.vocab_multiple`` (an explicit vocab_size is checked when the run loads it)."""
    m = cfg.model
    if m.vocab_multiple < 1:
        raise ConfigError(f"model.vocab_multiple = {m.vocab_multiple}: must be at least 1")
    if m.tokenizer == "bytes" or "vocab_size" in table.get("model", {}):
        return
    from .tokenizer import open_tokenizer, padded_vocab_size  # it imports this module

    m.vocab_size = padded_vocab_size(m, open_tokenizer(m.tokenizer))


def _check_activation_checkpoint(ac: ActivationCheckpointConfig) -> None:
    """``selective_ac_option`` is "op" or a positive block period (mode is a Literal)."""
    option = ac.selective_ac_option
    if option != "op" and not (option.isdigit() and int(option) >= 1):
        raise ConfigError(
            f"activation_checkpoint.selective_ac_option = {option!r}: must be 'op' or a "
            "positive integer n (recompute every n-th block)"
        )
