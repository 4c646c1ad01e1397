"""Tokenizers: ``[model] tokenizer = "bytes"`` (UTF-8 bytes, vocabulary 256), the path
of a Hugging Face ``tokenizer.json`` (the ``tokenizers`` library), whose post-processor
decides BOS/EOS, or of a tiktoken BPE file (``*.tiktoken`` / ``tokenizer.model``, read
with ``tiktoken``). The model's vocabulary is the tokenizer's, padded up to
``model.vocab_multiple``, unless the config names a ``model.vocab_size`` that holds it:
the loader reads the tokenizer to fill the model, as it reads a Hugging Face
config.json, so the tokenizer sits with the config, below every layer that encodes."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Protocol

import torch

from .schema import ConfigError, ModelConfig


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
        try:
            self.inner = RustTokenizer.from_file(str(self.path))
        except Exception as err:  # tokenizers' own error names neither file nor key
            raise ConfigError(
                f"model.tokenizer '{self.path}': not a valid tokenizer.json ({err})"
            ) from None
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


# Llama 3's pre-tokenisation pattern (tiktoken's cl100k_base), for tiktoken BPE files
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TIKTOKEN_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>")  # the ids after the ranks


class TiktokenTokenizer:
    """A tiktoken BPE file (one ``base64(token) rank`` per line, the format of Llama 3's
    ``tokenizer.model``) read with ``tiktoken.load.load_tiktoken_bpe``, split with Llama
    3's pattern; ``<|begin_of_text|>`` and ``<|end_of_text|>`` take the next two ids and
    every encoded text starts with BOS, as Llama 3 starts its documents."""

    def __init__(self, path: str | Path) -> None:
        try:
            import tiktoken
            from tiktoken.load import load_tiktoken_bpe
        except ImportError:
            raise ConfigError(
                "model.tokenizer = a tiktoken BPE file needs the `tiktoken` package "
                "(pip install tiktoken)"
            ) from None
        self.path = Path(path)
        if not self.path.is_file():
            raise ConfigError(f"model.tokenizer '{path}': no such tiktoken BPE file")
        # tiktoken caches files by path: the content's hash makes it re-read a changed file
        digest = hashlib.sha256(self.path.read_bytes()).hexdigest()
        try:
            ranks = load_tiktoken_bpe(str(self.path), expected_hash=digest)
        except ValueError as err:  # base64 or rank that does not parse
            raise ConfigError(
                f"model.tokenizer '{path}': not a tiktoken BPE file ({err})"
            ) from None
        specials = {name: len(ranks) + i for i, name in enumerate(TIKTOKEN_SPECIALS)}
        self.inner = tiktoken.Encoding(
            self.path.name, pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks, special_tokens=specials
        )
        self.vocab_size = self.inner.n_vocab
        self.bos, self.eos = specials[TIKTOKEN_SPECIALS[0]], specials[TIKTOKEN_SPECIALS[1]]

    def encode(self, text: str) -> torch.Tensor:
        # special-token text inside the data is encoded as plain text, never as a special
        ids = self.inner.encode(text, disallowed_special=())
        return torch.tensor([self.bos, *ids], dtype=torch.long)

    def decode(self, tokens: torch.Tensor) -> str:
        return self.inner.decode(tokens.tolist(), errors="replace")

    def special_ids(self) -> dict[str, int]:
        return {"bos_token_id": self.bos, "eos_token_id": self.eos}

    def save(self, folder: Path) -> None:
        """The file itself, as ``tokenizer.tiktoken`` (flexshard-generate reads it;
        transformers' AutoTokenizer needs a tokenizer.json)."""
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(self.path, folder / "tokenizer.tiktoken")


def open_tokenizer(name: str) -> Tokenizer:
    """``"bytes"``, a tokenizer.json (or a folder holding one), else a tiktoken file."""
    if name == "bytes":
        return ByteTokenizer()
    path = Path(name)
    if path.suffix == ".json" or (path / "tokenizer.json").is_file():
        return HFTokenizer(path)
    if not path.is_file():
        raise ConfigError(
            f"model.tokenizer '{name}': no such file; give \"bytes\", a tokenizer.json or "
            "a tiktoken BPE file"
        )
    return TiktokenTokenizer(path)


def padded_vocab_size(cfg: ModelConfig, tokenizer: Tokenizer) -> int:
    """The tokenizer's ids rounded up to a multiple of ``model.vocab_multiple``."""
    multiple = cfg.vocab_multiple
    return -(-tokenizer.vocab_size // multiple) * multiple


def load_tokenizer(cfg: ModelConfig) -> Tokenizer:
    """The configured tokenizer, checked against ``model.vocab_size``."""
    tokenizer = open_tokenizer(cfg.tokenizer)
    if cfg.vocab_size < tokenizer.vocab_size:
        raise ConfigError(
            f"model.vocab_size = {cfg.vocab_size} is smaller than the tokenizer's "
            f"{tokenizer.vocab_size} ids ({cfg.tokenizer}); set --model.vocab_size "
            f"{padded_vocab_size(cfg, tokenizer)} or leave it out (the tokenizer's, padded "
            f"to model.vocab_multiple = {cfg.vocab_multiple})"
        )
    return tokenizer
