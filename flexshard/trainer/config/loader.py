"""The trainer's configuration loaded from a TOML file and overridden from the command
line (``--training.steps 20``) into the dataclasses of ``schema``, then validated
(``validation``), with clear errors."""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from pathlib import Path
from typing import Any, Literal

from .hf_config import folder_fields
from .schema import (
    ActivationCheckpointConfig,
    Config,
    ConfigError,
)
from .validation import layout_without_mtp, validate


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
    return config_from_dict(_merge(table, parse_overrides(overrides or [])))


def config_from_dict(table: dict[str, Any]) -> Config:
    """A Config from a nested dict (as ``Config.to_dict`` gives), validated."""
    cfg = Config()
    given = table.get("model", {})  # the [model] keys written, before the folder's
    table = _model_from_folder(table)  # a folder's vocab_size is given, as if written here
    _fill(cfg, table, "")
    _folder_mtp_for_layout(cfg, given)
    _vocab_from_tokenizer(cfg, table)
    _check_activation_checkpoint(cfg.activation_checkpoint)
    _resolve_placement(cfg)
    validate(cfg)
    return cfg


def _resolve_placement(cfg: Config) -> None:
    """``placement = "auto"``: the matrix optimizers' communication-free layout where it
    applies (the flexshard backend without explicit buckets), FSDP2's rows otherwise."""
    par = cfg.parallelism
    if par.placement != "auto":
        return
    matrices = cfg.training.optimizer in ("muon", "soap", "shampoo")
    owned = matrices and par.dp_backend == "flexshard" and not par.buckets
    par.placement = "muon" if owned else "shard0"


def _model_from_folder(table: dict[str, Any]) -> dict[str, Any]:
    """``table`` whose ``[model]`` keys left out are those of the Hugging Face folder it
    starts from (``initial_load_in_hf``): the folder's config.json is the model; keys
    given must agree with it (``check_matches``, at start-up). A folder that is not
    there is left to the start-up checks, which name it."""
    checkpoint, given = table.get("checkpoint", {}), table.get("model", {})
    if not isinstance(checkpoint, dict) or not isinstance(given, dict):
        return table  # _fill names the mistake
    path = checkpoint.get("initial_load_path")
    if not (checkpoint.get("initial_load_in_hf") is True and isinstance(path, str) and path):
        return table
    if not Path(path).is_dir():
        return table
    return {**table, "model": _merge(folder_fields(path), given)}


def _folder_mtp_for_layout(cfg: Config, given: Any) -> None:
    """A folder's MTP depths (``model.mtp_layers`` not written) are left out where the
    layout trains no MTP (``layout_without_mtp``: tp, pp, cp, rl), so such a folder runs
    there as one without depths (the load says so in one line: ``hf_load_notes``); an
    ``mtp_layers`` written is kept, and refused there by the layout's check."""
    if isinstance(given, dict) and "mtp_layers" not in given and layout_without_mtp(cfg):
        cfg.model.mtp_layers = 0


def _vocab_from_tokenizer(cfg: Config, table: dict[str, Any]) -> None:
    """A tokenizer file and no ``model.vocab_size``: the tokenizer's ids, padded up to
    ``model.vocab_multiple`` (an explicit vocab_size is checked when the run loads it)."""
    m = cfg.model
    if m.vocab_multiple < 1:
        raise ConfigError(f"model.vocab_multiple = {m.vocab_multiple}: must be at least 1")
    if m.tokenizer == "bytes" or "vocab_size" in table.get("model", {}):
        return
    # here, not at the top: the tokenizers import torch, which the command lines' --help
    # (reading the schema through this package) must not pay for
    from .tokenizer import open_tokenizer, padded_vocab_size

    m.vocab_size = padded_vocab_size(m, open_tokenizer(m.tokenizer))


def _check_activation_checkpoint(ac: ActivationCheckpointConfig) -> None:
    """``selective_ac_option`` is "op" or a positive block period (mode is a Literal)."""
    option = ac.selective_ac_option
    if option != "op" and not (option.isdigit() and int(option) >= 1):
        raise ConfigError(
            f"activation_checkpoint.selective_ac_option = {option!r}: must be 'op' or a "
            "positive integer n (recompute every n-th block)"
        )
