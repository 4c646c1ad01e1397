"""The trainer and Hugging Face ``transformers``: a ``LlamaForCausalLM`` folder
(``save_pretrained``, several safetensors shards) loads into the sharded trainer at
W = 1, 2 and 3 under several placements and gives the same logits; the trainer's HF
export of it is the same tensors and ``from_pretrained`` loads it; RoPE rows change
order both ways."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flexshard.checkpoint.hf_safetensors import half_to_interleaved, interleaved_to_half
from flexshard.testing import run_distributed
from flexshard.trainer import checkpointing
from flexshard.trainer.hf_checkpoint import export_hf
from flexshard.trainer.train import setup

from .trainer_cases import tiny_config


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
    3: [
        ("flexshard", "shard0"),
        ("flexshard", "block"),
        ("flexshard", "owned"),
        ("fsdp2", "shard0"),
    ],
}


def hf_llama(folder: Path, seed: int = 0) -> torch.nn.Module:
    """A random LlamaForCausalLM shaped like tiny_config's model, saved in 6 shards."""
    transformers = _transformers()
    config = transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=40,
        intermediate_size=34,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(folder, max_shard_size="20KB")
    return model


def probe_tokens() -> torch.Tensor:
    return torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(1))


def hf_logits(folder: Path) -> torch.Tensor:
    model = _transformers().LlamaForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        return model(probe_tokens()).logits


def _load_and_export(rank: int, world_size: int, folder: str) -> dict:
    out = {}
    for backend, placement in CASES[world_size]:
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
        export_hf(job, Path(folder) / name / "hf", max_shard_bytes=30_000)
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_hf_folder_loads_and_exports(tmp_path, world_size):
    reference = hf_llama(tmp_path / "hf")
    with torch.no_grad():
        expected = reference(probe_tokens()).logits
    original = {k: v for k, v in reference.state_dict().items()}
    results = run_distributed(_load_and_export, world_size, str(tmp_path), timeout=600)
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
