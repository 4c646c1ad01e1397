"""Text sources (shipped corpus, own files, a Hugging Face data
set saved to disk) and deterministic per-data-parallel-rank sampling."""

from __future__ import annotations

import glob
import os
from importlib import resources
from pathlib import Path

import torch

from ..config import ConfigError, DataConfig
from ..config.tokenizer import ByteTokenizer, Tokenizer

__all__ = [
    "ByteTokenizer",
    "DPSampler",
    "ValidationBatches",
    "builtin_corpus",
    "data_files",
    "load_tokens",
    "split_tokens",
]

CORPUS_FILE = "corpus.txt"  # public-domain text shipped as package data


def builtin_corpus() -> str:
    return resources.files("flexshard.trainer").joinpath(CORPUS_FILE).read_text("utf-8")


def data_files(patterns: list[str]) -> list[str]:
    """The files ``data.paths`` names, in order; every pattern matches readable files."""
    paths: list[str] = []
    for pattern in patterns:
        found = sorted(glob.glob(pattern, recursive=True))
        if not found:
            raise ConfigError(f"data.paths: '{pattern}' matches no file")
        for path in found:
            if not Path(path).is_file():
                raise ConfigError(f"data.paths: '{path}' (from '{pattern}') is not a file")
            if not os.access(path, os.R_OK):
                raise ConfigError(f"data.paths: '{path}' is not readable")
        paths.extend(found)
    return paths


def _read_files(patterns: list[str]) -> str:
    paths = data_files(patterns)
    return "\n".join(Path(p).read_text("utf-8", errors="replace") for p in paths)


def _read_hf_disk(cfg: DataConfig) -> str:
    try:
        import datasets  # optional: only for data.source = "hf_disk"
    except ImportError:
        raise ConfigError(
            'data.source = "hf_disk" needs the `datasets` package (pip install datasets)'
        ) from None
    try:
        loaded = datasets.load_from_disk(cfg.hf_path)
    except FileNotFoundError as err:  # datasets' message names neither key nor folder
        raise ConfigError(f"data.hf_path '{cfg.hf_path}': {err}") from None
    if isinstance(loaded, datasets.DatasetDict):
        if cfg.hf_split not in loaded:
            raise ConfigError(f"data.hf_split '{cfg.hf_split}' not in {list(loaded)}")
        loaded = loaded[cfg.hf_split]
    if cfg.hf_text_field not in loaded.column_names:
        raise ConfigError(f"data.hf_text_field '{cfg.hf_text_field}' not in {loaded.column_names}")
    return "\n".join(loaded[cfg.hf_text_field])


def load_tokens(cfg: DataConfig, tokenizer: Tokenizer) -> torch.Tensor:
    """The whole training text as one 1-D token tensor (every rank loads the same)."""
    if cfg.source == "builtin":
        text = builtin_corpus()
    elif cfg.source == "files":
        text = _read_files(cfg.paths)
    else:
        text = _read_hf_disk(cfg)
    return tokenizer.encode(text)


class DPSampler:
    """Which sequences each data-parallel rank trains on, as a pure function of the step.

    The text is cut into windows of ``seq_len + 1`` tokens (input plus shifted target,
    adjacent windows sharing one token); every epoch visits them in a seeded random
    order. Step ``s`` takes global samples ``[s*G, (s+1)*G)`` with ``G = dp * accum *
    batch``; rank ``r`` takes the contiguous slice ``r`` of it, micro-batch after
    micro-batch. So the ranks of one step never share a sample, a run with one rank and
    ``batch * dp`` sequences sees exactly the union, and a resumed run needs no state.
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        seq_len: int,
        batch_size: int,
        grad_accum: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
    ) -> None:
        self.windows = (tokens.numel() - 1) // seq_len
        if self.windows < 1:
            raise ConfigError(
                f"the text has {tokens.numel()} tokens, fewer than one sequence of "
                f"training.seq_len + 1 = {seq_len + 1}"
            )
        self.tokens, self.seq_len, self.seed = tokens, seq_len, seed
        self.batch_size, self.grad_accum = batch_size, grad_accum
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self._orders: dict[int, torch.Tensor] = {}

    @property
    def global_batch(self) -> int:
        return self.dp_size * self.grad_accum * self.batch_size

    def window_of(self, sample: int) -> int:
        epoch, position = divmod(sample, self.windows)
        if epoch not in self._orders:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._orders = {epoch: torch.randperm(self.windows, generator=gen)}
        return int(self._orders[epoch][position])

    def sample_ids(self, step: int, micro: int) -> list[int]:
        """Global sample indices of this rank's micro-batch ``micro`` at ``step``."""
        first = step * self.global_batch
        first += (self.dp_rank * self.grad_accum + micro) * self.batch_size
        return list(range(first, first + self.batch_size))

    def batch(self, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each [batch_size, seq_len] int64."""
        rows = []
        for sample in self.sample_ids(step, micro):
            start = self.window_of(sample) * self.seq_len
            rows.append(self.tokens[start : start + self.seq_len + 1])
        seqs = torch.stack(rows)
        return seqs[:, :-1], seqs[:, 1:]


def split_tokens(tokens: torch.Tensor, fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(training, validation): the last ``fraction`` of the text is held out."""
    cut = tokens.numel() - int(tokens.numel() * fraction)
    return tokens[:cut], tokens[cut:]


class ValidationBatches:
    """The held-out text in consecutive windows; validation batch ``i`` of data-parallel
    rank ``r`` is a fixed set of windows, the same at every validation (so the losses
    of two validations compare), the ranks' windows disjoint."""

    def __init__(
        self, tokens: torch.Tensor, seq_len: int, batch_size: int, dp_rank: int, dp_size: int
    ) -> None:
        self.windows = (tokens.numel() - 1) // seq_len
        if self.windows < 1:
            raise ConfigError(
                f"the validation text has {tokens.numel()} tokens, fewer than one sequence "
                f"of training.seq_len + 1 = {seq_len + 1}; raise validation.fraction"
            )
        self.tokens, self.seq_len, self.batch_size = tokens, seq_len, batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size

    def batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        first = (index * self.dp_size + self.dp_rank) * self.batch_size
        rows = []
        for sample in range(first, first + self.batch_size):
            start = sample % self.windows * self.seq_len
            rows.append(self.tokens[start : start + self.seq_len + 1])
        seqs = torch.stack(rows)
        return seqs[:, :-1], seqs[:, 1:]
