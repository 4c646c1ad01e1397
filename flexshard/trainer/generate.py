"""Text from a model with a KV cache: the prompt runs once, then one token per forward;
whole on one process (``load_model``) or sharded over the ranks as in training
(``load_sharded``). ``run_command`` runs ``flexshard-generate``'s parsed arguments
(the command line: ``generate_cli``)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from flexshard.checkpoint.hf_safetensors import check_safetensors_folder, load_hf_safetensors
from flexshard.checkpoint.safe_load import read_metadata
from flexshard.runtime.module import own_buckets

from .config import Config, ConfigError, config_from_dict, load_config
from .config.hf_config import folder_fields, folder_quantization, text_model_prefix
from .config.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer, open_tokenizer
from .models.hf_adapter import fused_experts, hf_keys, published_layout
from .models.layers import KVCache
from .models.model import Transformer, build_model
from .parallel.parallelize import checked_dims, parallelize


@torch.no_grad()
def generate(
    model: Transformer,
    prompt: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    seed: int = 0,
) -> torch.Tensor:
    """``prompt`` (1-D ids) followed by up to ``max_new_tokens`` new ids."""
    generator = torch.Generator().manual_seed(seed)
    sharded = dist.is_initialized() and bool(own_buckets(model))
    cache = KVCache(len(model.layers))
    out = []
    logits = model(prompt[None], cache)[0, -1]  # the model's own forward, cache growing
    for _ in range(max_new_tokens):
        if temperature <= 0:
            token = logits.argmax()
        else:
            scores = logits.float() / temperature
            if top_k:
                kth = scores.topk(min(top_k, scores.numel())).values[-1]
                scores = scores.masked_fill(scores < kth, float("-inf"))
            token = torch.multinomial(scores.softmax(-1), 1, generator=generator)[0]
        if sharded:  # ranks agree on the logits to rounding; rank 0 decides
            dist.broadcast(token, src=0)
        out.append(int(token))
        logits = model(torch.tensor([[out[-1]]]), cache)[0, -1]
    return torch.cat([prompt, torch.tensor(out, dtype=prompt.dtype)])


def run_config(checkpoint: str | Path, config: str | None = None) -> Config:
    """The run's config: from a Hugging Face config.json, or the TOML a DCP checkpoint
    was trained with."""
    folder = Path(checkpoint)
    if not folder.is_dir():
        raise ConfigError(f"--checkpoint '{folder}': no such folder")
    if (folder / "config.json").is_file():
        return config_from_dict({"model": folder_fields(folder)})
    if config is None:
        raise ConfigError(f"'{folder}' has no config.json: pass the run's --config")
    return load_config(config)


def check_files(checkpoint: str | Path) -> None:
    """The checkpoint's files readable (a HF folder's safetensors whole, a DCP step's
    .metadata), or a ValueError naming the file: said once, before any rank starts."""
    folder = Path(checkpoint)
    if (folder / "config.json").is_file():
        check_safetensors_folder(folder)
    elif (folder / ".metadata").is_file():
        read_metadata(folder)


def folder_tokenizer(folder: Path) -> Tokenizer:
    """The tokenizer a Hugging Face folder ships (tokenizer.json, or the tiktoken file a
    run with one exported), else bytes."""
    for name in ("tokenizer.json", "tokenizer.tiktoken"):
        if (folder / name).is_file():
            return open_tokenizer(str(folder / name))
    return ByteTokenizer()


def load_weights(model: nn.Module, cfg: Config, checkpoint: str | Path) -> None:
    """A HF folder's or a DCP checkpoint's weights into ``model`` (whole or sharded:
    every rank reads what it stores)."""
    folder = Path(checkpoint)
    if (folder / "config.json").is_file():
        state = model.state_dict()
        prefix = text_model_prefix(folder)
        tied, fused = cfg.model.tie_embeddings, fused_experts(folder)
        published = published_layout(folder, cfg.model)
        keys = hf_keys(list(state), cfg.model, tied, prefix, fused, published)
        load_hf_safetensors(folder, state, keys, quantization=folder_quantization(folder))
    else:
        import flexshard.checkpoint as ckpt

        ckpt.load(str(folder), model)


def load_model(checkpoint: str | Path, config: str | None = None) -> tuple[nn.Module, Tokenizer]:
    """The whole model and the tokenizer of a Hugging Face folder or a DCP checkpoint."""
    cfg = run_config(checkpoint, config)
    model = build_model(cfg.model)
    load_weights(model, cfg, checkpoint)
    folder = Path(checkpoint)
    if (folder / "config.json").is_file():
        return model.eval(), folder_tokenizer(folder)
    return model.eval(), load_tokenizer(cfg.model)


def load_sharded(checkpoint: str | Path, config: str | None = None) -> tuple[nn.Module, Tokenizer]:
    """The model sharded over the default process group by the trainer's
    ``parallelize`` with the default parallelism (flexshard, ``placement = "shard0"``),
    built on meta and left uninitialised for the checkpoint: no rank holds it whole."""
    cfg = run_config(checkpoint, config)
    cfg = config_from_dict({"model": cfg.to_dict()["model"]})  # default parallelism
    dims = checked_dims(cfg, dist.get_world_size())
    meshes = dims.meshes(dims.build_mesh("cpu"))
    (model,) = parallelize(cfg, dims, meshes, torch.device("cpu"), init=False).modules
    load_weights(model, cfg, checkpoint)
    folder = Path(checkpoint)
    if (folder / "config.json").is_file():
        return model.eval(), folder_tokenizer(folder)
    return model.eval(), load_tokenizer(cfg.model)


def _write_sample(args: argparse.Namespace, model: nn.Module, tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode(args.prompt)
    if prompt.numel() == 0:
        prompt = tokenizer.encode("\n")
    ids = generate(model, prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed)
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(tokenizer.decode(ids), flush=True)


def _sharded_main(args: argparse.Namespace) -> None:
    """One rank of a sharded generation (spawned here or started by torchrun)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    try:
        model, tokenizer = load_sharded(args.checkpoint, args.config)
        _write_sample(args, model, tokenizer)
    finally:
        dist.destroy_process_group()


def _spawned(rank: int, args: argparse.Namespace) -> None:
    _sharded_main(args)


def run_command(args: argparse.Namespace) -> None:
    """``flexshard-generate``'s parsed arguments: one process, spawned ranks or this
    torchrun rank; a bad input exits with one line."""
    try:
        run_config(args.checkpoint, args.config)  # a bad folder or config: say so once
        check_files(args.checkpoint)
        if args.nproc is not None and args.nproc < 1:
            raise ConfigError(f"--nproc {args.nproc}: must be at least 1")
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
            _sharded_main(args)
        elif args.nproc is not None:
            from .launch import spawn_local

            spawn_local(_spawned, args.nproc, (args,))
        else:
            _write_sample(args, *load_model(args.checkpoint, args.config))
    except (ConfigError, ValueError) as err:
        sys.exit(f"flexshard-generate: {err}")
