"""Tokenizers: ``[model] tokenizer = "bytes"`` (UTF-8 bytes, vocabulary 256) or the
path of a Hugging Face ``tokenizer.json`` (the ``tokenizers`` library), whose
post-processor decides BOS/EOS; the model's vocabulary must hold its ids."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

import torch

from .config import ConfigError, ModelConfig


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> torch.Tensor: ...

    def decode(self, tokens: torch.Tensor) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes are the tokens: vocabulary 256, no download, lossless."""

    vocab_size = 256

    def encode(self, text: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()

    def decode(self, tokens: torch.Tensor) -> str:
        return bytes(tokens.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``tokenizers`` tokenizer from its tokenizer.json; BOS/EOS as its
    post-processor adds them, and the ``bos_token``/``eos_token`` it names."""

    def __init__(self, path: str | Path) -> None:
        try:
            from tokenizers import Tokenizer as RustTokenizer
        except ImportError:
            raise ConfigError(
                "model.tokenizer = a tokenizer.json needs the `tokenizers` package "
                "(pip install tokenizers)"
            ) from None
        self.path = Path(path)
        if self.path.is_dir():
            self.path = self.path / "tokenizer.json"
        if not self.path.is_file():
            raise ConfigError(f"model.tokenizer '{path}': no such tokenizer.json")
        self.inner = RustTokenizer.from_file(str(self.path))
        self.vocab_size = self.inner.get_vocab_size(with_added_tokens=True)
        self.bos = self._special(("<|begin_of_text|>", "<s>", "<bos>", "[BOS]"))
        self.eos = self._special(("<|end_of_text|>", "</s>", "<eos>", "[EOS]"))

    def _special(self, names: tuple[str, ...]) -> str | None:
        vocab = self.inner.get_vocab(with_added_tokens=True)
        return next((name for name in names if name in vocab), None)

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor(self.inner.encode(text).ids, dtype=torch.long)

    def decode(self, tokens: torch.Tensor) -> str:
        return self.inner.decode(tokens.tolist(), skip_special_tokens=False)

    def special_ids(self) -> dict[str, int]:
        """``bos_token_id`` / ``eos_token_id`` for config.json."""
        out = {}
        for key, name in (("bos_token_id", self.bos), ("eos_token_id", self.eos)):
            if name is not None:
                out[key] = self.inner.token_to_id(name)
        return out

    def save(self, folder: Path) -> None:
        """tokenizer.json and the tokenizer_config.json ``AutoTokenizer`` reads."""
        folder.mkdir(parents=True, exist_ok=True)
        self.inner.save(str(folder / "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "clean_up_tokenization_spaces": False,
        }
        for key, name in (("bos_token", self.bos), ("eos_token", self.eos)):
            if name is not None:
                config[key] = name
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def load_tokenizer(cfg: ModelConfig) -> Tokenizer:
    """The configured tokenizer, checked against ``model.vocab_size``."""
    if cfg.tokenizer == "bytes":
        return ByteTokenizer()
    tokenizer = HFTokenizer(cfg.tokenizer)
    if cfg.vocab_size < tokenizer.vocab_size:
        padded = -(-tokenizer.vocab_size // 64) * 64
        raise ConfigError(
            f"model.vocab_size = {cfg.vocab_size} is smaller than the tokenizer's "
            f"{tokenizer.vocab_size} ids ({cfg.tokenizer}); set --model.vocab_size {padded} "
            "(padded to a multiple of 64)"
        )
    return tokenizer
