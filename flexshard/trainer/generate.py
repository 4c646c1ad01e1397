"""Text out: ``flexshard-generate --checkpoint <hf folder | dcp step folder> --prompt "..."``
(greedy with ``--temperature 0``, else sampled with ``--top-k``), one process, with a
KV cache: the prompt runs once, then one token per forward.

A Hugging Face folder brings its config.json and tokenizer; a DCP checkpoint of the
trainer (``checkpoint/step-N``) needs the run's ``--config`` for the model's sizes."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from flexshard.checkpoint.hf_safetensors import load_hf_safetensors

from .config import ConfigError, ModelConfig, config_from_dict, load_config
from .hf_adapter import hf_keys, model_fields, read_config
from .model import Attention, Transformer, apply_rope
from .tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

Cache = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values so far


def _attend(
    attn: Attention,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: tuple[torch.Tensor, torch.Tensor] | None,
):
    """``Attention.forward`` for new tokens ``x`` after the cached ones."""
    b, s, _ = x.shape
    q = apply_rope(attn.wq(x).view(b, s, attn.n_heads, attn.head_dim), cos, sin)
    k = apply_rope(attn.wk(x).view(b, s, attn.n_kv_heads, attn.head_dim), cos, sin)
    v = attn.wv(x).view(b, s, attn.n_kv_heads, attn.head_dim)
    start = 0
    if cache is not None:
        start = cache[0].shape[1]
        k, v = torch.cat([cache[0], k], dim=1), torch.cat([cache[1], v], dim=1)
    # new token j (position start + j) sees positions 0 .. start + j
    mask = torch.ones(s, start + s, dtype=torch.bool, device=x.device).tril(diagonal=start)
    repeat = attn.n_heads // attn.n_kv_heads
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.repeat_interleave(repeat, dim=2).transpose(1, 2),
        v.repeat_interleave(repeat, dim=2).transpose(1, 2),
        attn_mask=mask,
    )
    return attn.wo(out.transpose(1, 2).reshape(b, s, -1)), (k, v)


def forward_cached(model: Transformer, tokens: torch.Tensor, cache: Cache) -> torch.Tensor:
    """Logits of ``tokens`` placed after the ``cache``d ones; the cache grows."""
    start = cache[0][0].shape[1] if cache else 0
    cos, sin = model.rope(start + tokens.shape[1], tokens.device)
    cos, sin = cos[start:], sin[start:]
    x = model.tok_embeddings(tokens)
    first = not cache
    for i, layer in enumerate(model.layers):
        out, kv = _attend(
            layer.attention, layer.attention_norm(x), cos, sin, None if first else cache[i]
        )
        if first:
            cache.append(kv)
        else:
            cache[i] = kv
        x = x + out
        x = x + layer.feed_forward(layer.ffn_norm(x))
    return model.output(model.norm(x))


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
    cache: Cache = []
    logits = forward_cached(model, prompt[None], cache)[0, -1]
    out = []
    for _ in range(max_new_tokens):
        if temperature <= 0:
            token = int(logits.argmax())
        else:
            scores = logits.float() / temperature
            if top_k:
                kth = scores.topk(min(top_k, scores.numel())).values[-1]
                scores = scores.masked_fill(scores < kth, float("-inf"))
            token = int(torch.multinomial(scores.softmax(-1), 1, generator=generator))
        out.append(token)
        logits = forward_cached(model, torch.tensor([[token]]), cache)[0, -1]
    return torch.cat([prompt, torch.tensor(out, dtype=prompt.dtype)])


def load_model(checkpoint: str | Path, config: str | None = None) -> tuple[Transformer, Tokenizer]:
    """The model and tokenizer of a Hugging Face folder or a trainer DCP checkpoint."""
    folder = Path(checkpoint)
    if (folder / "config.json").is_file():
        cfg = config_from_dict({"model": model_fields(read_config(folder))}).model
        model = Transformer(cfg)
        state = model.state_dict()
        tied = bool(read_config(folder).get("tie_word_embeddings", False))
        load_hf_safetensors(folder, state, hf_keys(list(state), cfg, tied))
        has_tokenizer = (folder / "tokenizer.json").is_file()
        return model.eval(), HFTokenizer(folder) if has_tokenizer else ByteTokenizer()
    if config is None:
        raise ConfigError(f"'{folder}' has no config.json: pass the run's --config")
    import flexshard.checkpoint as ckpt

    cfg: ModelConfig = load_config(config).model
    model = Transformer(cfg)
    ckpt.load(str(folder), model)
    return model.eval(), load_tokenizer(cfg)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="flexshard-generate", description=__doc__)
    parser.add_argument("--checkpoint", required=True, help="HF folder or DCP step folder")
    parser.add_argument("--config", help="the run's TOML (DCP checkpoints only)")
    parser.add_argument("--prompt", default="")
    parser.add_argument("--max-new-tokens", type=int, default=100)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=0, help="0: the whole vocabulary")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        model, tokenizer = load_model(args.checkpoint, args.config)
    except (ConfigError, ValueError) as err:
        sys.exit(f"flexshard-generate: {err}")
    prompt = tokenizer.encode(args.prompt)
    if prompt.numel() == 0:
        prompt = tokenizer.encode("\n")
    ids = generate(model, prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed)
    print(tokenizer.decode(ids))


if __name__ == "__main__":
    main()
