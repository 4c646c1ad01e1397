"""Train the small byte-level BPE tokenizer shipped with the trainer on the shipped
corpus: ``python scripts/train_tokenizer.py [--vocab 512] [--out configs/tokenizer]``.

Byte-level (GPT-2 style) pre-tokenisation, so every text encodes without an unknown
token; ``<s>`` is added at the start of every encoded text (the trainer's documents)."""

from __future__ import annotations

import argparse
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from flexshard.trainer.data import builtin_corpus


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--out", default="configs/tokenizer")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train(args.vocab, builtin_corpus()).save(str(out / "tokenizer.json"))
    print(f"wrote {out / 'tokenizer.json'}")


if __name__ == "__main__":
    main()
