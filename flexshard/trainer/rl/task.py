"""The verifiable task RL trains on, generated here: sort a few letters.

A prompt reads ``"sort dbca:"``, its answer ``"abcd"`` followed by the end-of-answer
byte ``"\\n"``. Step ``s``'s prompts are a pure function of (seed, s), so a resumed run
needs no task state. ``corpus`` writes the same format with the answers, for the
pre-training run RL starts from."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import ConfigError, RLConfig

LETTERS = "abcdefghij"
EOS = "\n"
PREFIX = "sort "


@dataclass(frozen=True)
class Prompt:
    text: str
    answer: str


def prompt_len(n_letters: int) -> int:
    """Bytes of a prompt of ``n_letters`` letters."""
    return len(PREFIX) + n_letters + 1


def check_task(cfg: RLConfig, seq_len: int) -> None:
    """Start-up: the task's sizes, and room in ``training.seq_len`` for its longest
    prompt and at least one answer byte."""
    if not 1 <= cfg.task_min_len <= cfg.task_max_len:
        raise ConfigError(
            f"rl.task_min_len = {cfg.task_min_len}, rl.task_max_len = {cfg.task_max_len}: "
            "need 1 <= task_min_len <= task_max_len"
        )
    longest = prompt_len(cfg.task_max_len)
    if longest + 1 > seq_len:
        raise ConfigError(
            f"rl.task_max_len = {cfg.task_max_len} makes prompts of {longest} tokens, longer "
            f"than the context training.seq_len = {seq_len} allows (prompt + 1 token)"
        )


def sample(cfg: RLConfig, generator: torch.Generator) -> Prompt:
    n = int(torch.randint(cfg.task_min_len, cfg.task_max_len + 1, (), generator=generator))
    picks = torch.randint(len(LETTERS), (n,), generator=generator).tolist()
    letters = "".join(LETTERS[i] for i in picks)
    return Prompt(f"{PREFIX}{letters}:", "".join(sorted(letters)))


def prompts(cfg: RLConfig, seed: int, step: int) -> list[Prompt]:
    """The global batch of prompts of RL step ``step`` (every rank computes all)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return [sample(cfg, generator) for _ in range(cfg.prompts_per_step)]


def corpus(cfg: RLConfig, seed: int, lines: int = 20000) -> str:
    """Pre-training text: prompts and their answers, one per line."""
    generator = torch.Generator().manual_seed(seed + 7919)  # not the RL steps' prompts
    return "".join(
        f"{p.text}{p.answer}{EOS}" for p in (sample(cfg, generator) for _ in range(lines))
    )


def reward(prompt: Prompt, completion: str) -> float:
    """1.0 for the sorted letters exactly; else the share of answer positions right
    (over the longer of answer and completion), so near misses score between."""
    if completion == prompt.answer:
        return 1.0
    right = sum(a == b for a, b in zip(completion, prompt.answer))
    return right / max(len(completion), len(prompt.answer))
