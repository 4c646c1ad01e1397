"""Hugging Face folders in and out of the trainer under pipeline and expert parallelism.

Dense (``LlamaForCausalLM``) under pp2: each stage loads its layers, the first step's
loss is transformers' loss on the same batch, and the export (planned from the whole
model's shapes) is the same files as pp1's, bit for bit the original tensors. MoE
(``MixtralForCausalLM``, whose routing is the trainer's: softmax, top-k, renormalised,
no shared expert) under ep1 and ep2: logits within 1e-5 of transformers', the export
bit for bit the original per-expert tensors. After two steps the layouts' losses and
exports agree within the layout tests' tolerances. MoE configs with no Hugging Face
twin are ConfigErrors at start-up. Slow, on 4 ranks: dp2 x pp2 (flexshard and FSDP2),
tp2 x pp2 and interleaved stages from a folder with tied embeddings; dp2 x pp2 x ep2,
tp2 x ep2, ep4 and FSDP2's ep2; and ``run``'s own path under dp2 x pp2 x ep2.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flexshard.testing import run_distributed
from flexshard.trainer.checkpointing import checkpoints as checkpointing
from flexshard.trainer.checkpointing.checkpoints import export
from flexshard.trainer.config import ConfigError, load_config
from flexshard.trainer.config.hf_config import check_matches
from flexshard.trainer.data.dataset import ByteTokenizer, DPSampler, load_tokens
from flexshard.trainer.train import loss_fn, run, setup, train_step

from ..helpers.trainer_cases import tiny_config
from .test_parallel_layouts import LOSS_RTOL, PARAM_ATOL

LOGIT_ATOL = 1e-5  # as tests/trainer/test_trainer_hf.py: fp32 logits against transformers'
HF_MODEL = {"vocab_size": 300, "rope_theta": 10000.0, "n_layers": 4}
MIXTRAL = {
    "num_experts": 4,
    "top_k": 2,
    "expert_hidden": 24,
    "num_shared_experts": 0,
    "first_dense_layers": 0,
}
SHARD_BYTES = 30_000  # several files, so the file plan is compared too
GLOBAL_BATCH = 4
STEPS = 2


def _transformers():
    """Imported in the parent only: the spawned ranks need not pay for it."""
    return pytest.importorskip("transformers")


def _hf_shape(moe: bool, tied: bool = False) -> dict:
    return {
        "vocab_size": 300,
        "hidden_size": 40,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": tied,
        **(
            {"intermediate_size": 24, "num_local_experts": 4, "num_experts_per_tok": 2}
            if moe
            else {"intermediate_size": 34}
        ),
    }


def hf_model(folder: Path, moe: bool, tied: bool = False) -> torch.nn.Module:
    """A random LlamaForCausalLM (or MixtralForCausalLM) shaped like the configs
    below, saved in several shards. The MoE's router and experts are drawn 10x wider
    than transformers' init, so that routing and the experts move the logits (a
    mapping with two experts swapped is off by ~1e-1)."""
    transformers = _transformers()
    kind = transformers.MixtralConfig if moe else transformers.LlamaConfig
    torch.manual_seed(0)
    model = (transformers.MixtralForCausalLM if moe else transformers.LlamaForCausalLM)(
        kind(**_hf_shape(moe, tied))
    ).eval()
    if moe:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if ".mlp." in name:
                    param.normal_(0.0, 0.2)
    model.save_pretrained(folder, max_shard_size="20KB")
    return model


def probe_tokens() -> torch.Tensor:
    return torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(1))


def _config(folder: str, name: str, parallelism: dict, moe: bool, tied: bool = False):
    dp = parallelism.get("dp_shard", 1) * parallelism.get("dp_replicate", 1)
    return tiny_config(
        f"{folder}/{name}",
        model={**HF_MODEL, "moe": MIXTRAL} if moe else HF_MODEL,
        parallelism=parallelism,
        training={"steps": STEPS, "batch_size": GLOBAL_BATCH // dp},
        checkpoint={
            "initial_load_path": f"{folder}/{'tied' if tied else 'hf'}",
            "initial_load_in_hf": True,
            "last_save_in_hf": True,
        },
    )


def _load_train_export(folder: str, name: str, parallelism: dict, moe: bool, tied: bool) -> dict:
    """Load the HF folder, export it as loaded, the probe's logits (without pp or tp),
    two steps, export again."""
    job = setup(_config(folder, name, parallelism, moe, tied))
    checkpointing.initial_load(job)
    export(job, Path(folder) / name / "loaded", max_shard_bytes=SHARD_BYTES)
    out: dict = {}
    if job.parallel.runner is None and job.dims.tp == 1:  # (SP would cut the probe)
        with torch.no_grad():
            out["logits"] = job.model(probe_tokens()).numpy()
    out["losses"] = [train_step(job, step)[0] for step in range(STEPS)]
    export(job, Path(folder) / name / "trained", max_shard_bytes=SHARD_BYTES)
    return out


def _layouts(rank: int, world_size: int, folder: str, layouts: dict, moe: bool, tied: bool):
    return {
        name: _load_train_export(folder, name, parallelism, moe, tied)
        for name, parallelism in layouts.items()
    }


def _files(folder: Path) -> dict[str, torch.Tensor]:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(str(folder / file)))
    return tensors


def _same_files(a: Path, b: Path) -> None:
    """The same shard files, byte for byte (names, headers, data) and the same index."""
    names = sorted(p.name for p in a.glob("*.safetensors"))
    assert len(names) > 1 and names == sorted(p.name for p in b.glob("*.safetensors"))
    for file in names + ["model.safetensors.index.json", "config.json"]:
        assert (a / file).read_bytes() == (b / file).read_bytes(), (a, b, file)


def _hf_loss(model: torch.nn.Module, cfg) -> float:
    """transformers' loss on the trainer's first global batch (the trainer's loss_fn)."""
    t = cfg.training
    sampler = DPSampler(
        load_tokens(cfg.data, ByteTokenizer()), t.seq_len, GLOBAL_BATCH, 1, 0, 1, t.seed
    )
    inputs, targets = sampler.batch(0)
    with torch.no_grad():
        return loss_fn(model(inputs).logits, targets).item()


def _check(tmp_path: Path, reference, results: list[dict], moe: bool, tied: bool = False) -> None:
    transformers = _transformers()
    auto = transformers.MixtralForCausalLM if moe else transformers.LlamaForCausalLM
    original = _files(tmp_path / ("tied" if tied else "hf"))  # as transformers saved them
    if tied:  # the trainer's output projection is its own tensor, written as lm_head
        original["lm_head.weight"] = original["model.embed_tokens.weight"]
    names = list(results[0])
    with torch.no_grad():
        expected = reference(probe_tokens()).logits
    first = _hf_loss(reference, _config(str(tmp_path), names[0], {}, moe, tied))
    base = results[0][names[0]]["losses"]
    for name in names:
        losses = results[0][name]["losses"]
        assert all(r[name]["losses"] == losses for r in results), name  # every rank agrees
        assert abs(losses[0] - first) <= LOSS_RTOL * first, (name, losses[0], first)
        assert max(abs(a - b) / b for a, b in zip(losses, base)) <= LOSS_RTOL, (name, losses)
        for rank_result in results:
            if "logits" in rank_result[name]:
                logits = torch.from_numpy(rank_result[name]["logits"])
                assert (logits - expected).abs().max().item() <= LOGIT_ATOL, name
        loaded = tmp_path / name / "loaded"
        exported = _files(loaded)
        # transformers 5 saves Mixtral's experts one tensor each, as the export does
        assert set(exported) == set(original), name
        changed = [k for k, v in original.items() if not torch.equal(exported[k], v)]
        assert changed == [], (name, changed)  # fp32 round trip: the original, bit for bit
        _same_files(tmp_path / names[0] / "loaded", loaded)
        trained, trained_base = (
            _files(loaded.parent / "trained"),
            _files(tmp_path / names[0] / "trained"),
        )
        gap = max((trained[k] - trained_base[k]).abs().max().item() for k in trained_base)
        assert gap <= PARAM_ATOL, (name, gap)
    after = auto.from_pretrained(tmp_path / names[-1] / "trained").eval()
    with torch.no_grad():
        moved = (after(probe_tokens()).logits - expected).abs().max().item()
    assert moved > 1e-3, moved  # it trained, and transformers loads the trained export


PP = {"pp1": {"dp_shard": 2}, "pp2": {"dp_shard": 1, "pp": 2}}
EP = {"ep1": {"dp_shard": 2}, "ep2": {"dp_shard": 2, "ep": 2}}


def _biased_first_loss(folder: str) -> float:
    """A "bias"-balanced run from the Mixtral folder: its bias (model state no HF
    format holds) starts at zero, so the first step routes as Mixtral."""
    cfg = _config(folder, "bias", EP["ep2"], True)
    cfg.model.moe.balance, cfg.checkpoint.last_save_in_hf = "bias", False
    job = setup(cfg)
    checkpointing.initial_load(job)
    return train_step(job, 0)[0]


def _pp_and_ep(rank: int, world_size: int, root: str) -> dict:
    return {
        "pp": _layouts(rank, world_size, f"{root}/llama", PP, False, False),
        "ep": _layouts(rank, world_size, f"{root}/mixtral", EP, True, False),
        "bias": _biased_first_loss(f"{root}/mixtral"),
    }


def test_llama_under_pp2_and_mixtral_under_ep2_as_on_one_stage(tmp_path):
    """One launch of 2 ranks (spawning them is most of the time): a Llama folder under
    pp1 and pp2, a Mixtral folder under ep1 and ep2 (and into a "bias" run)."""
    llama = hf_model(tmp_path / "llama" / "hf", moe=False)
    mixtral = hf_model(tmp_path / "mixtral" / "hf", moe=True)
    results = run_distributed(_pp_and_ep, 2, str(tmp_path), timeout=600)
    _check(tmp_path / "llama", llama, [r["pp"] for r in results], moe=False)
    _check(tmp_path / "mixtral", mixtral, [r["ep"] for r in results], moe=True)
    first = _hf_loss(mixtral, _config(str(tmp_path), "-", {}, True))
    assert abs(results[0]["bias"] - first) <= LOSS_RTOL * first, (results[0]["bias"], first)


SLOW_PP = {
    "dp4": {"dp_shard": 4},
    "dp2xpp2": {"dp_shard": 2, "pp": 2},
    "tp2xpp2": {"dp_shard": 1, "tp": 2, "pp": 2},
    "dp2xpp2_fsdp2": {"dp_shard": 2, "pp": 2, "dp_backend": "fsdp2"},
    "pp2_interleaved": {
        "dp_shard": 2,
        "pp": 2,
        "pp_schedule": "interleaved_1f1b",
        "pp_virtual_stages": 2,
    },
}
SLOW_EP = {
    "ep1": {"dp_shard": 4},
    "dp2xpp2xep2": {"dp_shard": 2, "pp": 2, "ep": 2},
    "tp2xep2": {"dp_shard": 2, "tp": 2, "ep": 2},
    "ep4": {"dp_shard": 4, "ep": 4},
    "dp4xep2_fsdp2": {"dp_shard": 4, "ep": 2, "dp_backend": "fsdp2"},
}


@pytest.mark.slow
def test_hf_folder_under_pp_layouts_with_tied_embeddings(tmp_path):
    """A tied folder (lm_head read from the embedding): stage 0 and the last stage
    read the same HF tensor."""
    reference = hf_model(tmp_path / "tied", moe=False, tied=True)
    results = run_distributed(_layouts, 4, str(tmp_path), SLOW_PP, False, True, timeout=900)
    _check(tmp_path, reference, results, moe=False, tied=True)


@pytest.mark.slow
def test_mixtral_folder_under_pp_tp_and_ep4(tmp_path):
    reference = hf_model(tmp_path / "hf", moe=True)
    results = run_distributed(_layouts, 4, str(tmp_path), SLOW_EP, True, False, timeout=900)
    _check(tmp_path, reference, results, moe=True)


def _run_pp2_ep2(rank: int, world_size: int, folder: str) -> list[dict]:
    return run(_config(folder, "run", {"dp_shard": 2, "pp": 2, "ep": 2}, moe=True))


@pytest.mark.slow
def test_run_reads_and_writes_mixtral_under_pp2_ep2(tmp_path):
    """``run``'s own path: initial_load_in_hf and last_save_in_hf under dp2 x pp2 x ep2."""
    reference = hf_model(tmp_path / "hf", moe=True)
    records = run_distributed(_run_pp2_ep2, 4, str(tmp_path), timeout=900)[0]
    first = _hf_loss(reference, _config(str(tmp_path), "run", {}, True))
    assert abs(records[0]["loss"] - first) <= LOSS_RTOL * first
    exported = tmp_path / "run" / "hf"
    assert json.loads((exported / "config.json").read_text())["model_type"] == "mixtral"
    after = _transformers().MixtralForCausalLM.from_pretrained(exported).eval()
    assert set(after.state_dict()) == set(reference.state_dict())


# ---------------------------------------------------------------------- refusals
BASE = (
    "[model]\ndim = 40\nn_layers = 2\nn_heads = 4\nn_kv_heads = 2\n[model.moe]\nnum_experts = 4\n"
)


@pytest.mark.parametrize(
    "override, message",
    [
        (["--checkpoint.last_save_in_hf", "true"], "last_save_in_hf: .*num_shared_experts = 1"),
        (
            ["--checkpoint.initial_load_in_hf", "true", "--checkpoint.initial_load_path", "x"]
            + ["--model.moe.num_shared_experts", "0"],
            "initial_load_in_hf: .*first_dense_layers = 1",
        ),
        (
            [
                "--checkpoint.last_save_in_hf",
                "true",
                "--model.moe.num_shared_experts",
                "0",
                "--model.moe.first_dense_layers",
                "0",
                "--model.moe.balance",
                "bias",
                "--parallelism.ep",
                "2",
            ],
            'last_save_in_hf: .*balance = "bias"',
        ),
    ],
)
def test_moe_without_a_hf_twin_is_refused_at_start_up(override, message, tmp_path):
    base = tmp_path / "moe.toml"
    base.write_text(BASE)
    with pytest.raises(ConfigError, match=message):
        load_config(base, override)


def test_mixtral_configs_are_accepted_on_every_layout(tmp_path):
    base = tmp_path / "moe.toml"
    base.write_text(BASE + 'num_shared_experts = 0\nfirst_dense_layers = 0\nbalance = "bias"\n')
    common = ["--checkpoint.initial_load_in_hf", "true", "--checkpoint.initial_load_path", "x"]
    common += ["--parallelism.pp", "2"]
    cfg = load_config(base, common + ["--parallelism.ep", "2"])  # bias: fine for loading
    assert cfg.parallelism.pp == 2 and cfg.parallelism.ep == 2
    cfg = load_config(
        base, common + ["--model.moe.balance", "aux", "--checkpoint.last_save_in_hf", "true"]
    )
    assert cfg.checkpoint.last_save_in_hf


def test_folder_of_another_model_names_the_keys(tmp_path):
    """A Llama folder for an MoE config (and a Mixtral one for a dense config): the
    keys that differ, with the overrides."""
    for moe, folder in ((False, "llama"), (True, "mixtral")):
        (tmp_path / folder).mkdir()
        kind = "mixtral" if moe else "llama"
        config = {"model_type": kind, **_hf_shape(moe)}
        (tmp_path / folder / "config.json").write_text(json.dumps(config))
    moe_cfg = tiny_config("-", model={**HF_MODEL, "moe": MIXTRAL}).model
    dense_cfg = tiny_config("-", model=HF_MODEL).model
    with pytest.raises(ConfigError, match=r"moe.num_experts \(4 here, 0 there\)"):
        check_matches(moe_cfg, tmp_path / "llama")
    with pytest.raises(ConfigError, match=r"--model.moe.num_experts 4"):
        check_matches(dense_cfg, tmp_path / "mixtral")
    assert check_matches(moe_cfg, tmp_path / "mixtral")["moe"]["num_experts"] == 4
    wrong = tiny_config("-", model={**HF_MODEL, "moe": {**MIXTRAL, "expert_hidden": 0}}).model
    with pytest.raises(ConfigError, match=r"moe.expert_hidden \(34 here, 24 there\)"):
        check_matches(wrong, tmp_path / "mixtral")


def test_generation_from_a_mixtral_folder_matches_transformers(tmp_path):
    """flexshard-generate reads a Mixtral folder too: transformers' greedy tokens."""
    from flexshard.trainer.generate import generate, load_model

    reference = hf_model(tmp_path / "hf", moe=True)
    model, _ = load_model(tmp_path / "hf")
    prompt = torch.tensor([5, 17, 99, 3])
    theirs = reference.generate(prompt[None], max_new_tokens=12, do_sample=False)[0]
    assert generate(model, prompt, max_new_tokens=12).tolist() == theirs.tolist()
