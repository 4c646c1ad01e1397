"""Text in and out: a tokenizer.json (``tokenizers``) as the trainer's tokenizer, saved
with the export so ``transformers``' AutoTokenizer reads it; a tiktoken BPE file with the
same merges encodes as it does; the vocabulary taken from the tokenizer; generation with
a KV cache equals a full forward per token and ``transformers``' own greedy ``generate``."""

from __future__ import annotations

import re

import pytest
import torch

from flexshard.testing import run_distributed
from flexshard.trainer.config import ConfigError, config_from_dict, load_config
from flexshard.trainer.config.tokenizer import HFTokenizer, TiktokenTokenizer, load_tokenizer
from flexshard.trainer.data.dataset import builtin_corpus
from flexshard.trainer.generate import generate, load_model, load_sharded
from flexshard.trainer.models.layers import KVCache
from flexshard.trainer.models.model import Transformer, init_weights

from .test_trainer_hf import hf_llama

tokenizers = pytest.importorskip("tokenizers")


def tiny_bpe(path, vocab: int = 300) -> None:
    """A BPE tokenizer trained here on the shipped corpus (no download), BOS first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(builtin_corpus()[:20000].splitlines(keepends=True), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    tok.save(str(path))


def test_tokenizer_json(tmp_path):
    tiny_bpe(tmp_path / "tokenizer.json")
    model = config_from_dict(
        {"model": {"tokenizer": str(tmp_path / "tokenizer.json"), "vocab_size": 320}}
    ).model
    tok = load_tokenizer(model)
    text = "MENENIUS: What work's, my countrymen, in hand? ünïcode"
    ids = tok.encode(text)
    assert ids[0].item() == tok.special_ids()["bos_token_id"] == 0
    assert ids.numel() < len(text.encode())  # merges happened
    assert tok.decode(ids[1:]) == text
    tok.save(tmp_path / "export")
    auto = pytest.importorskip("transformers").AutoTokenizer.from_pretrained(tmp_path / "export")
    assert auto(text)["input_ids"] == ids.tolist()
    model.vocab_size = 256
    with pytest.raises(ConfigError, match="model.vocab_size 320"):
        load_tokenizer(model)


def test_shipped_tokenizer_round_trips_the_corpus():
    tok = HFTokenizer("configs/tokenizer/tokenizer.json")
    text = builtin_corpus()
    ids = tok.encode(text)
    assert tok.vocab_size == 512 and ids.numel() < len(text.encode()) / 1.5
    assert tok.decode(ids[1:]) == text


SHIPPED = "configs/tokenizer/tokenizer"


def test_tiktoken_file_encodes_as_the_tokenizer_json_it_was_written_from():
    pytest.importorskip("tiktoken")
    hf, tik = HFTokenizer(f"{SHIPPED}.json"), TiktokenTokenizer(f"{SHIPPED}.tiktoken")
    assert tik.vocab_size == hf.vocab_size == 512  # 510 ranks + BOS and EOS
    text = builtin_corpus()
    ids = tik.encode(text)
    assert ids[0].item() == tik.bos == 510 and tik.decode(ids[1:]) == text
    # each word alone is one pre-token for both libraries' patterns, so both must apply
    # the same merges: tiktoken's rank r is the tokenizer.json's id r + 2 (<s>, </s>)
    words = sorted(set(re.findall(r" ?[A-Za-z]+", text)))
    differing = [w for w in words if (hf.encode(w)[1:] - 2).tolist() != tik.encode(w)[1:].tolist()]
    assert len(words) > 2000 and differing == []
    assert ids.numel() < len(text.encode()) / 1.5  # merges happened


def test_tiktoken_file_rereads_a_changed_file_and_rejects_garbage(tmp_path):
    pytest.importorskip("tiktoken")
    path = tmp_path / "tokenizer.tiktoken"
    lines = open(f"{SHIPPED}.tiktoken").read().splitlines()
    path.write_text("\n".join(lines[:300]) + "\n")
    assert TiktokenTokenizer(path).vocab_size == 302
    path.write_text("\n".join(lines) + "\n")  # same path (tiktoken caches by path)
    assert TiktokenTokenizer(path).vocab_size == 512
    path.write_text("not base64 at all\n")
    with pytest.raises(ConfigError, match="not a tiktoken BPE file"):
        TiktokenTokenizer(path)


def test_vocabulary_comes_from_the_tokenizer_padded_to_the_multiple(tmp_path):
    pytest.importorskip("tiktoken")
    shipped = load_config("configs/bpe_debug.toml")  # names no vocab_size
    assert shipped.model.vocab_size == 512
    for tokenizer, multiple, expected in [("json", 96, 576), ("tiktoken", 100, 600)]:
        overrides = ["--model.tokenizer", f"{SHIPPED}.{tokenizer}"]
        cfg = load_config(None, [*overrides, "--model.vocab_multiple", str(multiple)])
        assert cfg.model.vocab_size == expected, tokenizer
        assert load_tokenizer(cfg.model).vocab_size == 512
        # the config carries the resolved size to the ranks (the launcher's round trip)
        assert config_from_dict(cfg.to_dict()).model.vocab_size == expected
    explicit = load_config(None, [*overrides, "--model.vocab_size", "1000"])
    assert explicit.model.vocab_size == 1000  # named: kept
    small = load_config(None, [*overrides, "--model.vocab_size", "500"])
    with pytest.raises(ConfigError, match="set --model.vocab_size 512 or leave it out"):
        load_tokenizer(small.model)
    with pytest.raises(ConfigError, match="model.vocab_multiple = 0"):
        load_config(None, [*overrides, "--model.vocab_multiple", "0"])
    with pytest.raises(ConfigError, match="no such file"):
        load_config(None, ["--model.tokenizer", str(tmp_path / "missing.model")])


def test_kv_cache_equals_full_forward():
    cfg = config_from_dict({"model": {"dim": 40, "n_heads": 4, "n_kv_heads": 2}}).model
    model = Transformer(cfg).eval()
    init_weights(model, 0)
    tokens = torch.randint(0, 256, (1, 13), generator=torch.Generator().manual_seed(0))
    cache = KVCache(cfg.n_layers)
    with torch.no_grad():
        full = model(tokens)
        stepped = [model(tokens[:, :5], cache)]
        stepped += [model(tokens[:, i : i + 1], cache) for i in range(5, 13)]
    assert (torch.cat(stepped, dim=1) - full).abs().max().item() < 1e-5


def test_greedy_generation_matches_transformers(tmp_path):
    reference = hf_llama(tmp_path / "hf")
    model, tok = load_model(tmp_path / "hf")
    prompt = torch.tensor([5, 17, 99, 3])
    ours = generate(model, prompt, max_new_tokens=12)
    theirs = reference.generate(prompt[None], max_new_tokens=12, do_sample=False)[0]
    assert ours.tolist() == theirs.tolist()
    sampled = generate(model, prompt, 12, temperature=1.0, top_k=5, seed=1)
    assert (
        sampled.tolist() == generate(model, prompt, 12, temperature=1.0, top_k=5, seed=1).tolist()
    )
    assert sampled.numel() == 16


PROMPT = [5, 17, 99, 3]


def _sharded_generation(rank: int, world_size: int, folder: str) -> tuple:
    model, _ = load_sharded(folder)  # each rank reads its Shard(0) rows of the HF folder
    prompt = torch.tensor(PROMPT)
    greedy = generate(model, prompt, 12).tolist()
    sampled = generate(model, prompt, 12, temperature=1.0, top_k=5, seed=1).tolist()
    stored = sum(p.to_local().numel() for p in model.parameters())
    return greedy, sampled, stored


def test_sharded_generation_equals_one_process(tmp_path):
    hf_llama(tmp_path / "hf")  # kv rows 20, ffn 34, vocab 300: W = 3 divides none
    model, _ = load_model(tmp_path / "hf")
    prompt = torch.tensor(PROMPT)
    greedy = generate(model, prompt, 12).tolist()
    sampled = generate(model, prompt, 12, temperature=1.0, top_k=5, seed=1).tolist()
    results = run_distributed(_sharded_generation, 3, str(tmp_path / "hf"), timeout=300)
    assert [r[:2] for r in results] == [(greedy, sampled)] * 3
    total = sum(p.numel() for p in model.parameters())
    assert sum(r[2] for r in results) == total and max(r[2] for r in results) < total / 2


def test_one_process_generation_from_a_dcp_checkpoint_warns_nothing(tmp_path):
    """No warning of flexshard's making: DCP's "assuming one process" included."""
    import warnings
    from pathlib import Path

    import flexshard.checkpoint as ckpt

    config = str(Path(__file__).parents[2] / "configs" / "debug.toml")
    model = Transformer(load_config(config).model)
    init_weights(model, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ckpt.save(tmp_path / "step-1", model)
        loaded, tokenizer = load_model(tmp_path / "step-1", config)
        generate(loaded, tokenizer.encode("a"), 2, 0.0, 0, 0)
    assert all(torch.equal(a, b) for a, b in zip(loaded.parameters(), model.parameters()))
