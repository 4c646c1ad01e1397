"""Completions from the policy itself: the trained (sharded) model's own forward with
its KV cache, prompts of one length per batch, and one log-probability function that
the generator and the trainer share.

Every rank runs the same forwards in lockstep (a sharded model gathers its buckets in
each): the batches follow the global prompts' lengths, a rank without prompts of a
length runs a stand-in row, and decoding stops when no rank has an unfinished row."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..models.layers import KVCache


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """log p(token) under ``softmax(logits / temperature)``, float32: the sampling
    distribution, for generator and trainer alike."""
    scaled = logits.float() / temperature
    return scaled.log_softmax(-1).gather(-1, tokens[..., None])[..., 0]


@dataclass
class Completion:
    prompt: torch.Tensor  # 1-D ids
    tokens: torch.Tensor  # 1-D ids, ending with eos when ``finished``
    logprobs: torch.Tensor  # the generator's, one per token
    finished: bool  # ended with eos (else cut at the token budget)


def _any_unfinished(done: torch.Tensor) -> bool:
    left = torch.tensor([int((~done).sum())])
    if dist.is_initialized():
        dist.all_reduce(left)
    return int(left) > 0


@torch.no_grad()
def generate(
    model: nn.Module,
    prompts: torch.Tensor,
    max_new_tokens: int,
    eos: int,
    temperature: float,
    generator: torch.Generator,
) -> list[Completion]:
    """Sample up to ``max_new_tokens`` per row of ``prompts`` [rows, length] (every rank
    calls it with the same ``max_new_tokens``)."""
    n_layers = len(model.layers)  # type: ignore[arg-type]
    cache = KVCache(n_layers)
    rows = prompts.shape[0]
    logits = model(prompts, cache)[:, -1]
    done = torch.zeros(rows, dtype=torch.bool)
    tokens, logprobs = [], []
    for index in range(max_new_tokens):
        probs = (logits.float() / temperature).softmax(-1)
        token = torch.multinomial(probs, 1, generator=generator)[:, 0]
        tokens.append(token)
        logprobs.append(token_logprobs(logits, token, temperature))
        done |= token == eos
        if index + 1 == max_new_tokens or not _any_unfinished(done):
            break
        logits = model(token[:, None], cache)[:, -1]
    drawn, scores = torch.stack(tokens, 1), torch.stack(logprobs, 1)
    out = []
    for row in range(rows):
        ends = (drawn[row] == eos).nonzero()
        length = int(ends[0]) + 1 if len(ends) else drawn.shape[1]
        out.append(
            Completion(prompts[row], drawn[row, :length], scores[row, :length], bool(len(ends)))
        )
    return out


def rollout(
    model: nn.Module,
    mine: list[torch.Tensor],
    lengths: list[int],
    group_size: int,
    max_new_tokens: int,
    context: int,
    eos: int,
    temperature: float,
    generator: torch.Generator,
) -> list[list[Completion]]:
    """``group_size`` completions of each of this rank's prompts ``mine``, in order;
    ``lengths``: every prompt length of the global batch (the same list on every rank).
    A row gets at most ``context - prompt length`` new tokens."""
    out: list[list[Completion]] = [[] for _ in mine]
    for length in sorted(set(lengths)):
        chosen = [i for i, p in enumerate(mine) if p.numel() == length]
        rows = [mine[i] for i in chosen for _ in range(group_size)]
        stand_in = not rows  # keeps this rank's forwards in step with the others'
        batch = torch.stack(rows) if rows else torch.zeros(1, length, dtype=torch.long)
        new = min(max_new_tokens, context - length)
        done = generate(model, batch, new, eos, temperature, generator)
        if stand_in:
            continue
        for j, i in enumerate(chosen):
            out[i] = done[j * group_size : (j + 1) * group_size]
    return out
