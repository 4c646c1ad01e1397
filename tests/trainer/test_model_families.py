"""Every Hugging Face family of the trainer (``config.hf_config.FAMILIES``, its key
names in ``hf_adapter.FAMILY_KEYS``) against transformers' own class, built from its
config and saved with ``save_pretrained``:

- the config side and the state-dict side name the same families;

- the folder is the model: ``config_from_dict`` with only ``initial_load_path`` /
  ``initial_load_in_hf`` builds it from config.json (sizes, ``head_dim``, q/k norms,
  tied embeddings, eps and RoPE theta off the trainer's defaults, MoE layers), and
  its fp32 logits are transformers' within 1e-5 (every norm weight drawn at random, so
  a q/k norm read in the wrong RoPE order is off by ~1e-1);
- the export of the loaded model (W = 2, sharded) is the folder's tensors bit for bit,
  and ``from_pretrained`` loads it with no missing or unexpected key;
- ``flexshard-train --nproc 2`` with nothing but the folder trains and exports, and
  ``flexshard-generate``'s greedy tokens are transformers';
- a tied embedding stays one parameter under both dp backends, and a DCP checkpoint
  of it resumes bit for bit;
- config.json features the trainer lacks, a ``[model]`` that differs, and a tied
  embedding under pp are ConfigErrors naming the key.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flexshard.checkpoint.hf_safetensors import load_hf_safetensors
from flexshard.testing import run_distributed
from flexshard.trainer.checkpointing import checkpoints as checkpointing
from flexshard.trainer.checkpointing.checkpoints import export
from flexshard.trainer.config import ConfigError, config_from_dict
from flexshard.trainer.config import hf_config as config_side
from flexshard.trainer.config.hf_config import check_matches, hf_config, model_fields
from flexshard.trainer.launch import main as train_main
from flexshard.trainer.models import hf_adapter
from flexshard.trainer.models.hf_adapter import hf_keys
from flexshard.trainer.models.layers import loss_fn
from flexshard.trainer.models.model import Transformer
from flexshard.trainer.train import run, setup

from ..helpers.trainer_cases import launch_dims
from .test_parallel_layouts import QWEN3, layout_config

# 6 steps, no clipping (the backends sum the norm in different orders), constant lr
FULL = {"steps": 6, "max_norm": 0.0, "decay": "none"}
HALF = {**FULL, "steps": 3}

LOGIT_ATOL = 1e-5
# 4 layers, heads of 12 (not hidden_size / heads = 10), eps and theta not the trainer's
SHAPE = {
    "vocab_size": 300,
    "hidden_size": 40,
    "intermediate_size": 34,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
}
QWEN3_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24}
# name: (transformers class, config class, config.json keys beside SHAPE)
FAMILIES = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", {}),
    "mixtral": (
        "MixtralForCausalLM",
        "MixtralConfig",
        {"intermediate_size": 24, "num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", {"head_dim": 12, "tie_word_embeddings": True}),
    # layer 0 dense, the others MoE; the chosen weights as the softmax gives them
    "qwen3_moe": (
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        {"head_dim": 12, **QWEN3_MOE, "norm_topk_prob": False, "mlp_only_layers": [0]},
    ),
    # every second layer MoE (1 and 3), renormalised weights
    "qwen3_moe_step2": (
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        {**QWEN3_MOE, "norm_topk_prob": True, "decoder_sparse_step": 2},
    ),
}


def test_config_and_key_tables_name_the_same_families():
    assert list(config_side.FAMILIES) == list(hf_adapter.FAMILY_KEYS)


def _transformers():
    return pytest.importorskip("transformers")


def hf_model(folder: Path, family: str) -> torch.nn.Module:
    """A random model of ``family`` saved in several shards. Norm weights drawn around
    1 and the MoE's router and experts 10x wider than transformers' init, so that every
    tensor's mapping moves the logits."""
    transformers = _transformers()
    model_class, config_class, extra = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**{**SHAPE, **extra})
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.3)
            elif ".mlp." in name and "moe" in family:
                param.normal_(0.0, 0.2)
    model.save_pretrained(folder, max_shard_size="20KB")
    return model


def probe_tokens() -> torch.Tensor:
    return torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(1))


def matches_transformers(
    name: str, model: torch.nn.Module, reference: torch.nn.Module, batch: torch.Tensor
) -> torch.Tensor:
    """Our logits within 1e-5 of transformers' ``reference`` on ``batch`` and the loss
    within 1e-4 of its own; transformers' logits, for the checks after."""
    with torch.no_grad():
        ours = model(batch)
        out = reference(batch, labels=batch)
        loss = loss_fn(ours[:, :-1], batch[:, 1:]).item()
    gap = (ours - out.logits).abs().max().item()
    print(f"{name}: logits within {gap:.1e}, loss {loss} vs {out.loss.item()}")
    assert gap <= 1e-5, gap
    assert abs(loss - out.loss.item()) <= 1e-4
    return out.logits


def from_folder(folder: Path, **sections: dict) -> dict:
    """A config table with no [model]: the folder says what the model is."""
    table: dict = {
        "checkpoint": {"initial_load_path": str(folder), "initial_load_in_hf": True},
        "training": {"steps": 2, "seq_len": 16, "batch_size": 2},
        "job": {"progress": False, "plot": False, "tensorboard": False},
    }
    for name, values in sections.items():
        table[name] = {**table.get(name, {}), **values}
    return table


@pytest.mark.parametrize("family", list(FAMILIES))
def test_folder_is_the_model_and_logits_match(family, tmp_path):
    reference = hf_model(tmp_path, family)
    cfg = config_from_dict(from_folder(tmp_path))
    m = cfg.model
    assert (m.norm_eps, m.rope_theta, m.n_layers) == (1e-6, 10000.0, 4)
    assert m.qk_norm == family.startswith("qwen3")
    assert m.tie_embeddings == (family == "qwen3")
    experts = reference.config.to_dict().get("num_experts") or 4
    moe_layers = [m.moe.is_moe_layer(i) for i in range(4)]
    assert (
        moe_layers
        == {
            "llama": [False] * 4,
            "mixtral": [True] * 4,
            "qwen3": [False] * 4,
            "qwen3_moe": [False, True, True, True],
            "qwen3_moe_step2": [False, True, False, True],
        }[family]
    )
    assert m.moe.num_experts in (0, experts)
    model = Transformer(m).eval()
    state = model.state_dict()
    load_hf_safetensors(tmp_path, state, hf_keys(list(state), m, m.tie_embeddings))
    if m.tie_embeddings:
        assert model.output.weight is model.tok_embeddings.weight
    with torch.no_grad():
        gap = (model(probe_tokens()) - reference(probe_tokens()).logits).abs().max().item()
    print(f"{family}: logits within {gap:.1e} of transformers'")
    assert gap <= LOGIT_ATOL, gap


# ---------------------------------------------------------------------- export
EXPORTED = ["qwen3", "qwen3_moe", "qwen3_moe_step2"]


def _load_and_export(rank: int, world_size: int, folder: str) -> None:
    for family in EXPORTED:
        source = Path(folder) / family
        cfg = config_from_dict(from_folder(source, job={"dump_folder": f"{source}/run"}))
        job = setup(cfg)
        checkpointing.initial_load(job)
        export(job, source / "export", max_shard_bytes=30_000)


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in folder.glob("*.safetensors"):
        out.update(load_file(str(file)))
    return out


def test_export_loads_in_transformers_with_every_key(tmp_path):
    transformers = _transformers()
    references = {family: hf_model(tmp_path / family, family) for family in EXPORTED}
    run_distributed(_load_and_export, 2, str(tmp_path), timeout=600)
    for family, reference in references.items():
        exported = tmp_path / family / "export"
        original = _tensors(tmp_path / family)
        got = _tensors(exported)
        assert set(got) == set(original), family  # a tied lm_head is not written
        assert [k for k, v in original.items() if not torch.equal(got[k], v)] == [], family
        model_class = getattr(transformers, FAMILIES[family][0])
        loaded, info = model_class.from_pretrained(exported, output_loading_info=True)
        assert all(not v for v in info.values()), (family, info)
        with torch.no_grad():
            same = torch.equal(
                loaded.eval()(probe_tokens()).logits, reference(probe_tokens()).logits
            )
        assert same, family
        config = json.loads((exported / "config.json").read_text())
        assert config["model_type"] == family.removesuffix("_step2"), config
        assert check_matches(config_from_dict(from_folder(exported)).model, tmp_path / family)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_flexshard_train_with_only_the_folder(family, tmp_path, capfd):
    """The command line with nothing but the folder: it trains and exports a folder the
    same class loads, with every key."""
    transformers = _transformers()
    reference = hf_model(tmp_path / "hf", family)
    out = tmp_path / "run"
    train_main(
        ["--nproc", "2", "--checkpoint.initial_load_path", str(tmp_path / "hf")]
        + ["--checkpoint.initial_load_in_hf", "true", "--checkpoint.last_save_in_hf", "true"]
        + ["--training.steps", "3", "--training.seq_len", "16", "--job.dump_folder", str(out)]
        + ["--job.progress", "false", "--job.plot", "false", "--job.tensorboard", "false"]
    )
    model_class = getattr(transformers, FAMILIES[family][0])
    trained, info = model_class.from_pretrained(out / "hf", output_loading_info=True)
    assert all(not v for v in info.values()), info
    with torch.no_grad():
        moved = (trained.eval()(probe_tokens()).logits - reference(probe_tokens()).logits).abs()
    assert moved.max().item() > 1e-3  # it trained
    assert f"initial weights from {tmp_path / 'hf'}" in capfd.readouterr().out


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_generation_from_the_folder_matches_transformers(family, tmp_path):
    """flexshard-generate's model (its own forward, with the KV cache and the q/k
    norms) gives transformers' greedy tokens."""
    from flexshard.trainer.generate import generate, load_model

    reference = hf_model(tmp_path / "hf", family)
    model, _ = load_model(tmp_path / "hf")
    prompt = torch.tensor([5, 17, 99, 3])
    theirs = reference.generate(prompt[None], max_new_tokens=12, do_sample=False)[0]
    assert generate(model, prompt, max_new_tokens=12).tolist() == theirs.tolist()


def test_sharded_generation_of_a_tied_folder(tmp_path, capfd):
    """``flexshard-generate --nproc 2`` on a tied Qwen3 folder (the table sharded once,
    serving as embedding and output) prints what one process prints."""
    from flexshard.trainer.generate_cli import main as generate_main

    hf_model(tmp_path / "hf", "qwen3")
    args = ["--checkpoint", str(tmp_path / "hf"), "--prompt", "MENENIUS:", "--max-new-tokens", "8"]
    generate_main(args)
    whole = capfd.readouterr().out
    generate_main(args + ["--nproc", "2"])
    assert capfd.readouterr().out == whole and whole.startswith("MENENIUS:")


# ---------------------------------------------------------------------- tied checkpoints
def _resumed_tied(rank: int, world_size: int, folder: str) -> dict[str, list[float]]:
    """A tied Qwen3 under both dp backends: 6 steps at once, and 3 then 3 more from the
    DCP checkpoint of step 3."""
    out = {}
    for backend in ("flexshard", "fsdp2"):
        parallelism = {"dp_shard": 2, "dp_backend": backend}
        whole = run(
            layout_config(
                f"{folder}/{backend}/whole", parallelism, None, model=QWEN3, training=FULL
            )
        )
        ckpt = {"enable": True, "interval": 3}
        cut = f"{folder}/{backend}/cut"
        first = run(
            layout_config(cut, parallelism, None, model=QWEN3, checkpoint=ckpt, training=HALF)
        )
        rest = run(
            layout_config(cut, parallelism, None, model=QWEN3, checkpoint=ckpt, training=FULL)
        )
        out[backend] = [r["loss"] for r in whole]
        out[f"{backend}_resumed"] = [r["loss"] for r in first + rest]
    return out


def test_tied_embeddings_checkpoint_and_resume(tmp_path):
    losses = run_distributed(_resumed_tied, 2, str(tmp_path), timeout=600)[0]
    for backend in ("flexshard", "fsdp2"):
        assert len(losses[f"{backend}_resumed"]) == 6
        assert losses[f"{backend}_resumed"] == losses[backend], backend  # bit for bit
    assert losses["flexshard"] == losses["fsdp2"]  # Shard(0), fp32: FSDP2's arithmetic


# ---------------------------------------------------------------------- refusals
def _write(folder: Path, config: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


QWEN3_JSON = {"model_type": "qwen3", **SHAPE, "head_dim": 12}


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"use_sliding_window": True, "sliding_window": 8}, "use_sliding_window = True"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
        ({"attention_bias": True}, "attention_bias = True"),
        ({"hidden_act": "gelu"}, "hidden_act = 'gelu'"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types has"),
        ({"model_type": "gemma2"}, "model_type 'gemma2': the trainer supports"),
    ],
)
def test_unsupported_config_json_names_the_key(extra, message, tmp_path):
    folder = _write(tmp_path / "hf", {**QWEN3_JSON, **extra})
    with pytest.raises(ConfigError, match=message):
        model_fields(json.loads((folder / "config.json").read_text()))
    with pytest.raises(ConfigError, match=message):
        config_from_dict(from_folder(folder))


def test_model_section_beside_the_folder_must_agree(tmp_path):
    folder = _write(tmp_path / "hf", QWEN3_JSON)
    # the keys given are kept, the rest come from the folder
    cfg = config_from_dict(from_folder(folder, model={"tokenizer": "bytes"}))
    assert (cfg.model.head_size(), cfg.model.qk_norm) == (12, True)
    cfg = config_from_dict(from_folder(folder, model={"head_dim": 10, "qk_norm": False}))
    with pytest.raises(ConfigError) as err:
        check_matches(cfg.model, folder)
    line = str(err.value)
    assert "\n" not in line and "head_dim (10 here, 12 there)" in line
    assert "--model.head_dim 12 --model.qk_norm true" in line


def test_first_dense_layers_export_as_mlp_only_layers(tmp_path):
    """The trainer's first dense layers are Qwen3-MoE's mlp-only ones: the config.json
    written says the same layers are MoE, and reads back as the same model."""
    moe = {"num_experts": 4, "num_shared_experts": 0, "first_dense_layers": 1}
    table = {"model": {"qk_norm": True, "n_layers": 4, "moe": {**moe, "mlp_only_layers": [2]}}}
    m = config_from_dict(table).model
    config = hf_config(m, "float32", 64)
    assert (config["model_type"], config["mlp_only_layers"]) == ("qwen3_moe", [0, 2])
    assert check_matches(m, _write(tmp_path / "hf", config)) == model_fields(config)
    back = config_from_dict(from_folder(tmp_path / "hf")).model
    assert [back.moe.is_moe_layer(i) for i in range(4)] == [False, True, False, True]


def test_tied_embedding_under_pp_is_refused(tmp_path):
    folder = _write(tmp_path / "hf", {**QWEN3_JSON, "tie_word_embeddings": True})
    with pytest.raises(ConfigError, match="model.tie_embeddings = true with parallelism.pp = 2"):
        launch_dims(config_from_dict(from_folder(folder, parallelism={"pp": 2})))
    # untied by the [model] key: the output starts as a copy of the embedding
    cfg = config_from_dict(
        from_folder(folder, parallelism={"pp": 2}, model={"tie_embeddings": False})
    )
    assert check_matches(cfg.model, folder)["tie_embeddings"]
