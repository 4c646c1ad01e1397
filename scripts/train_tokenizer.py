"""Train the small byte-level BPE tokenizer shipped with the trainer on the shipped
corpus: ``python scripts/train_tokenizer.py [--vocab 512] [--out configs/tokenizer]``.

Byte-level (GPT-2 style) pre-tokenisation, so every text encodes without an unknown
token; ``<s>`` is added at the start of every encoded text (the trainer's documents).
The same merges are also written as a tiktoken BPE file (``tokenizer.tiktoken``: base64
token bytes and rank per line), the format of Llama 3's ``tokenizer.model``."""

from __future__ import annotations

import argparse
import base64
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from flexshard.trainer.data.dataset import builtin_corpus


def train(vocab_size: int, text: str) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
    bos = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bos)]
    )
    return tokenizer


def byte_of_char() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's table), inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


def tiktoken_lines(tokenizer: Tokenizer) -> list[str]:
    """The tokens (special ones left out) as ``base64 rank`` lines, ranked in id order:
    the alphabet first, then the merges in the order they were learnt, which is the
    priority tiktoken gives the lower rank."""
    data = json.loads(tokenizer.to_str())
    specials = {token["content"] for token in data["added_tokens"]}
    to_byte = byte_of_char()
    tokens = sorted((i, t) for t, i in data["model"]["vocab"].items() if t not in specials)
    return [
        f"{base64.b64encode(bytes(to_byte[c] for c in token)).decode()} {rank}"
        for rank, (_, token) in enumerate(tokens)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--out", default="configs/tokenizer")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train(args.vocab, builtin_corpus())
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer.tiktoken").write_text("\n".join(tiktoken_lines(tokenizer)) + "\n")
    print(f"wrote {out / 'tokenizer.json'} and {out / 'tokenizer.tiktoken'}")


if __name__ == "__main__":
    main()
