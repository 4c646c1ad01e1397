"""The trainer and Hugging Face ``transformers``: a ``LlamaForCausalLM`` folder
(``save_pretrained``, several safetensors shards) loads into the sharded trainer at
W = 1, 2 and 3 under several placements and gives the same logits; the trainer's HF
export of it is the same tensors and ``from_pretrained`` loads it; RoPE rows change
order both ways; ``fs.checkpoint.export_safetensors`` of a sharded tied-embedding
model loads tied."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from flexshard.checkpoint.hf_safetensors import (
    half_to_interleaved,
    interleaved_to_half,
    load_hf_safetensors,
)
from flexshard.testing import run_distributed
from flexshard.trainer.checkpointing import checkpoints as checkpointing
from flexshard.trainer.checkpointing.checkpoints import export
from flexshard.trainer.components.optimizers import build_optimizer
from flexshard.trainer.config.tokenizer import ByteTokenizer
from flexshard.trainer.data.dataset import DPSampler, ValidationBatches, load_tokens, split_tokens
from flexshard.trainer.models.hf_adapter import hf_keys
from flexshard.trainer.models.model import Transformer
from flexshard.trainer.train import loss_fn, run, setup

from ..helpers.trainer_cases import set_lr, tiny_config


def _transformers():
    """Imported in the parent only: the spawned ranks need not pay for it."""
    return pytest.importorskip("transformers")


#: trainer vs transformers logits, fp32: measured 6e-8 (the issue asks <= 1e-5)
LOGIT_ATOL = 1e-5
HF_MODEL = {"vocab_size": 300, "rope_theta": 10000.0}  # [model] keys beside tiny_config's
#: (backend, placement) per world size: W = 3 cuts wq (40 rows, heads of 10) mid-head
CASES = {
    1: [("flexshard", "shard0")],
    2: [("flexshard", "flat"), ("fsdp2", "shard0")],
    3: [("flexshard", "shard0"), ("fsdp2", "shard0")],
    4: [("flexshard", "block"), ("flexshard", "owned"), ("flexshard", "flat")],  # W = 3 too
}
STEPS = 3


def llama_config(tied: bool = False) -> Any:
    """A LlamaConfig shaped like tiny_config's model."""
    return _transformers().LlamaConfig(
        vocab_size=300,
        hidden_size=40,
        intermediate_size=34,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
    )


def hf_llama(folder: Path, seed: int = 0) -> torch.nn.Module:
    """A random LlamaForCausalLM shaped like tiny_config's model, saved in 6 shards."""
    torch.manual_seed(seed)
    model = _transformers().LlamaForCausalLM(llama_config()).eval()
    model.save_pretrained(folder, max_shard_size="20KB")
    return model


def probe_tokens() -> torch.Tensor:
    return torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(1))


def hf_logits(folder: Path) -> torch.Tensor:
    model = _transformers().LlamaForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        return model(probe_tokens()).logits


def _load_and_export(rank: int, world_size: int, folder: str, case: int) -> dict:
    out = {}
    for backend, placement in CASES[case]:
        name = f"w{world_size}-{backend}-{placement}"
        cfg = tiny_config(
            f"{folder}/{name}",
            model=HF_MODEL,
            parallelism={"dp_backend": backend, "placement": placement},
            checkpoint={"initial_load_path": f"{folder}/hf", "initial_load_in_hf": True},
        )
        job = setup(cfg)
        checkpointing.initial_load(job)
        with torch.no_grad():
            out[name] = job.model(probe_tokens()).numpy()  # tensors die with the child
        export(job, Path(folder) / name / "hf", max_shard_bytes=30_000)
    return out


@pytest.mark.parametrize(
    "world_size, case",
    [
        (3, 3),
        pytest.param(1, 1, marks=pytest.mark.slow),
        pytest.param(2, 2, marks=pytest.mark.slow),
        pytest.param(3, 4, marks=pytest.mark.slow),
    ],
)
def test_hf_folder_loads_and_exports(tmp_path, world_size, case):
    reference = hf_llama(tmp_path / "hf")
    with torch.no_grad():
        expected = reference(probe_tokens()).logits
    original = {k: v for k, v in reference.state_dict().items()}
    results = run_distributed(_load_and_export, world_size, str(tmp_path), case, timeout=600)
    for rank_logits in results:
        for name, logits in rank_logits.items():
            gap = (torch.from_numpy(logits) - expected).abs().max().item()
            assert gap <= LOGIT_ATOL, (name, gap)
    for name in results[0]:
        folder = tmp_path / name / "hf"
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        files = set(index["weight_map"].values())
        assert len(files) > 1, files  # sharded, as asked
        exported = {}
        for file in files:
            exported.update(load_file(str(folder / file)))
        assert set(exported) == set(original), name
        # fp32 in, fp32 out, rows put back in HF order: bit for bit the original
        changed = [k for k, v in original.items() if not torch.equal(exported[k], v)]
        assert changed == [], (name, changed)
        assert (hf_logits(folder) - expected).abs().max().item() <= LOGIT_ATOL, name


def test_rope_row_order_both_ways():
    rows = torch.arange(2 * 10 * 3, dtype=torch.float32).view(20, 3)  # 2 heads of 10
    half = interleaved_to_half(rows, heads=2)
    assert torch.equal(half_to_interleaved(half, heads=2), rows)
    # head 0's pairs (0, 1), (2, 3), ... become rows i and i + 5
    assert half[:10, 0].tolist() == [0, 6, 12, 18, 24, 3, 9, 15, 21, 27]
    assert torch.equal(half[10:], interleaved_to_half(rows[10:], heads=1))


def _round_trip_config(folder: str):
    return tiny_config(
        f"{folder}/run",
        model=HF_MODEL,
        training={"steps": STEPS},
        validation={"enable": True, "freq": 2, "steps": 2, "fraction": 0.2},
        checkpoint={
            "initial_load_path": f"{folder}/hf",
            "initial_load_in_hf": True,
            "last_save_in_hf": True,
        },
    )


def _train_from_hf(rank: int, world_size: int, folder: str) -> list[dict]:
    return run(_round_trip_config(folder))


def _reference(cfg, folder: Path, dp_size: int) -> tuple[Transformer, list[float]]:
    """One process: the HF weights, the same global batches, validation on the union
    of the ranks' held-out batches."""
    t = cfg.training
    model = Transformer(cfg.model)
    state = model.state_dict()
    load_hf_safetensors(folder, state, hf_keys(list(state), cfg.model))
    train, held_out = split_tokens(load_tokens(cfg.data, ByteTokenizer()), 0.2)
    sampler = DPSampler(train, t.seq_len, dp_size * t.batch_size, 1, 0, 1, t.seed)
    validation = ValidationBatches(held_out, t.seq_len, dp_size * t.batch_size, 0, 1)
    optimizer = build_optimizer(model, t, cfg.model)
    val_losses = []
    for step in range(t.steps):
        set_lr(optimizer, step, t)
        inputs, targets = sampler.batch(step)
        loss_fn(model(inputs), targets).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.max_norm)
        optimizer.step()
        optimizer.zero_grad()
        if (step + 1) % 2 == 0 or step + 1 == t.steps:
            with torch.no_grad():
                batches = [validation.batch(i) for i in range(2)]
                val_losses.append(sum(loss_fn(model(x), y).item() for x, y in batches) / 2)
    return model.eval(), val_losses


def test_hf_train_hf_round_trip(tmp_path):
    """HF folder -> 3 steps at W = 3 (validation on) -> HF folder: transformers loads the
    export and computes the single-process reference's logits."""
    hf_llama(tmp_path / "hf")
    records = run_distributed(_train_from_hf, 3, str(tmp_path), timeout=600)[0]
    cfg = _round_trip_config(str(tmp_path))
    reference, val_losses = _reference(cfg, tmp_path / "hf", dp_size=3)
    got = [r["val_loss"] for r in records if "val_loss" in r]
    assert [r["step"] for r in records if "val_loss" in r] == [2, 3]
    assert max(abs(a - b) for a, b in zip(got, val_losses)) < 1e-4, (got, val_losses)
    exported = tmp_path / "run" / "hf"
    config = json.loads((exported / "config.json").read_text())
    assert config["model_type"] == "llama" and config["head_dim"] == 10
    with torch.no_grad():
        expected = reference(probe_tokens())
    start = hf_logits(tmp_path / "hf")
    after = hf_logits(exported)
    assert (after - expected).abs().max().item() < 1e-4
    assert (after - start).abs().max().item() > 1e-2  # it did train


def _export_tied(rank: int, world_size: int, folder: str, backend: str) -> None:
    """The ``model.safetensors`` export of a sharded tied-embedding model."""
    import transformers
    from torch.distributed.fsdp import fully_shard

    import flexshard as fs

    model = transformers.LlamaForCausalLM.from_pretrained(f"{folder}/hf")
    shard = fs.fully_shard if backend == "flexshard" else fully_shard
    for layer in model.model.layers:
        shard(layer)
    shard(model)
    fs.checkpoint.export_safetensors(model, Path(folder) / backend)


@pytest.mark.parametrize("backend", ["flexshard", "fsdp2"])
def test_tied_embedding_export_loads_in_transformers(tmp_path, backend):
    transformers = _transformers()
    config = llama_config(tied=True)
    torch.manual_seed(0)
    original = transformers.LlamaForCausalLM(config).eval()
    original.save_pretrained(tmp_path / "hf")
    run_distributed(_export_tied, 2, str(tmp_path), backend)
    (tmp_path / backend / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / backend).eval()
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    expected, got = original.state_dict(), loaded.state_dict()
    assert got.keys() == expected.keys()
    assert [k for k in expected if not torch.equal(got[k], expected[k])] == []
