"""DeepSeek-V3 folders with multi-token prediction depths (``num_nextn_predict_layers``;
depth k as ``model.layers.{n_layers + k}.*``, as DeepSeek publishes them), written here
with transformers' classes plus the MTP keys. The loaded depths' loss equals a
reference written from the paper's equations with transformers' own
``DeepseekV3DecoderLayer``; the export is the folder as it came (the same names, every
MTP tensor bit for bit, transformers reports the same unexpected keys); data
parallelism on placements at W = 3 (W = 2 and with ep: slow) trains 10 steps as one
process does, and exports the trained depths; ``run`` from the folder resumes exactly
(slow); a layout that trains no MTP leaves a folder's depths out unless
``model.mtp_layers`` is given, which is refused naming the key."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from flexshard.checkpoint.hf_safetensors import load_hf_safetensors
from flexshard.testing import run_distributed
from flexshard.trainer import launch
from flexshard.trainer.checkpointing import checkpoints as checkpointing
from flexshard.trainer.checkpointing.checkpoints import export, hf_load_notes
from flexshard.trainer.checkpointing.preflight import (
    StartupError,
    check_checkpoints,
    check_shared_copies,
)
from flexshard.trainer.components.optimizers import build_optimizer
from flexshard.trainer.config import Config, ConfigError, config_from_dict, load_config
from flexshard.trainer.config.hf_config import folder_fields
from flexshard.trainer.data.dataset import ByteTokenizer, DPSampler, load_tokens
from flexshard.trainer.models.hf_adapter import hf_keys
from flexshard.trainer.models.model import Transformer
from flexshard.trainer.models.moe import step_balance
from flexshard.trainer.models.mtp import take_step_loss
from flexshard.trainer.train import loss_fn, run, setup, train_step

from ..helpers.trainer_cases import launch_dims, set_lr, tiny_config, whole_parameters
from .test_deepseek_v3 import hf_deepseek, probe_tokens
from .test_parallel_layouts import LOSS_RTOL, NORM_RTOL, PARAM_ATOL

LOSS_ATOL = 1e-5  # fp32 against transformers' layer: measured below 1e-6
STEPS = 10
N_LAYERS = 3  # hf_deepseek's
EXPERTS = 8


def _transformers():
    return pytest.importorskip("transformers")


def _per_expert(prefix: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A transformers layer's state dict as save_pretrained writes it: the fused expert
    stacks as one tensor per expert."""
    out = {}
    for name, value in state.items():
        if name == "mlp.experts.gate_up_proj":
            gate, up = value.chunk(2, dim=1)
            for e in range(value.shape[0]):
                out[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = gate[e].contiguous()
                out[f"{prefix}mlp.experts.{e}.up_proj.weight"] = up[e].contiguous()
        elif name == "mlp.experts.down_proj":
            for e in range(value.shape[0]):
                out[f"{prefix}mlp.experts.{e}.down_proj.weight"] = value[e].contiguous()
        else:
            out[prefix + name] = value.contiguous()
    return out


def mtp_folder(folder: Path, depths: int = 1) -> tuple[torch.nn.Module, list[torch.nn.Module]]:
    """A DeepseekV3ForCausalLM folder (``hf_deepseek``) with ``depths`` MTP depths under
    DeepSeek's names: a ``DeepseekV3DecoderLayer`` each (MoE, weights of std 0.2, a random
    selection bias), random norms and projection, and the copies of the embedding and
    head DeepSeek's files carry. Returns the model and the depths' modules (``enorm``,
    ``hnorm``, ``eh_proj``, ``layer``, ``head_norm``), for the reference."""
    transformers = _transformers()
    modeling = transformers.models.deepseek_v3.modeling_deepseek_v3
    model = hf_deepseek(folder, q_lora_rank=24)
    config, dim = model.config, model.config.hidden_size
    tensors = load_file(str(folder / "model.safetensors"))
    torch.manual_seed(7)
    modules = []
    for k in range(depths):
        depth = torch.nn.ModuleDict(
            {
                "enorm": modeling.DeepseekV3RMSNorm(dim, config.rms_norm_eps),
                "hnorm": modeling.DeepseekV3RMSNorm(dim, config.rms_norm_eps),
                "eh_proj": torch.nn.Linear(2 * dim, dim, bias=False),
                "layer": modeling.DeepseekV3DecoderLayer(config, N_LAYERS + k),
                "head_norm": modeling.DeepseekV3RMSNorm(dim, config.rms_norm_eps),
            }
        ).eval()
        with torch.no_grad():
            for param in depth.parameters():
                if param.ndim >= 2:
                    param.normal_(0, 0.2)
                else:  # norms away from 1, so a swapped norm shows
                    param.copy_(1 + 0.2 * torch.randn_like(param))
            depth["layer"].mlp.gate.e_score_correction_bias.normal_(0, 0.1)
        modules.append(depth)
        prefix = f"model.layers.{N_LAYERS + k}."
        tensors.update(_per_expert(prefix, depth["layer"].state_dict()))
        tensors[prefix + "enorm.weight"] = depth["enorm"].weight.detach().clone()
        tensors[prefix + "hnorm.weight"] = depth["hnorm"].weight.detach().clone()
        tensors[prefix + "eh_proj.weight"] = depth["eh_proj"].weight.detach().clone()
        tensors[prefix + "shared_head.norm.weight"] = depth["head_norm"].weight.detach().clone()
        tensors[prefix + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        tensors[prefix + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    path = folder / "config.json"
    path.write_text(
        json.dumps({**json.loads(path.read_text()), "num_nextn_predict_layers": depths})
    )
    return model, modules


def reference_mtp_loss(
    model: torch.nn.Module, depths: list[torch.nn.Module], tokens: torch.Tensor
) -> torch.Tensor:
    """The MTP loss from DeepSeek-V3's equations (section 2.2), with transformers' modules:
    ``h_i^k = M_k [RMSNorm(Emb(t_{i+k})); RMSNorm(h_i^{k-1})]`` (the order of DeepSeek's
    released weights), ``h^k = TRM_k(h'^k)`` over positions ``1..T-k``, ``P^k =
    OutHead(RMSNorm(h^k))``, ``L^k = CE(P^k, t_{k+1..})``; the mean over the depths.
    ``h^0`` is the last decoder layer's output, before the final norm."""
    captured: list[torch.Tensor] = []
    hook = model.model.layers[-1].register_forward_hook(lambda m, i, o: captured.append(o))
    with torch.no_grad():
        model(tokens)
    hook.remove()
    hidden, s = captured[0], tokens.shape[1]
    losses = []
    with torch.no_grad():
        for k, depth in enumerate(depths, start=1):
            n = s - k
            embedded = model.model.embed_tokens(tokens[:, k:])
            joined = torch.cat([depth["enorm"](embedded), depth["hnorm"](hidden[:, :n])], -1)
            projected = depth["eh_proj"](joined)
            positions = torch.arange(n)[None].expand(tokens.shape[0], n)
            rope = model.model.rotary_emb(projected, positions)
            causal = torch.full((n, n), float("-inf")).triu(1)[None, None]
            hidden = depth["layer"](
                projected, attention_mask=causal, position_ids=positions, position_embeddings=rope
            )
            logits = model.lm_head(depth["head_norm"](hidden))[:, :-1]
            target = tokens[:, k + 1 :]
            losses.append(F.cross_entropy(logits.flatten(0, 1), target.flatten()))
    return torch.stack(losses).mean()


def trainer_model(folder: Path) -> Transformer:
    """The trainer's model of the folder, its MTP depths included."""
    cfg = config_from_dict({"model": folder_fields(folder)}).model
    model = Transformer(cfg)
    state = model.state_dict()
    load_hf_safetensors(folder, state, hf_keys(list(state), cfg))
    return model


@pytest.mark.parametrize("depths", [1, 2])
def test_loaded_depths_loss_is_the_papers(tmp_path, depths):
    reference, modules = mtp_folder(tmp_path, depths)
    model = trainer_model(tmp_path)
    assert model.cfg.mtp_layers == depths and model.mtp is not None
    tokens = probe_tokens()
    expected = reference_mtp_loss(reference, modules, tokens)
    model(tokens)  # with gradients on: the MTP depths run
    got = take_step_loss([model])
    assert got is not None and expected > 1.0
    print(f"depths {depths}: {float(got):.7f} vs {float(expected):.7f}")
    assert abs(float(got) - float(expected)) <= LOSS_ATOL
    # the main model is untouched by the depths: transformers' logits
    with torch.no_grad():
        gap = (model(tokens) - reference(tokens).logits).abs().max()
    assert gap <= LOSS_ATOL


def test_a_folder_without_depths_and_one_left_out(tmp_path):
    """transformers' config says one depth by default and save_pretrained writes none:
    such a folder loads with none. A folder with depths and --model.mtp_layers 0 loads
    without them, says so, and its config.json still matches [model]."""
    hf_deepseek(tmp_path / "plain", q_lora_rank=24)
    plain = json.loads((tmp_path / "plain" / "config.json").read_text())
    assert plain["num_nextn_predict_layers"] == 1
    assert folder_fields(tmp_path / "plain")["mtp_layers"] == 0
    assert hf_load_notes(tmp_path / "plain") == []
    mtp_folder(tmp_path / "mtp")
    folder = tmp_path / "mtp"
    note = hf_load_notes(folder, _config(str(tmp_path), "x", str(folder), {}, mtp_layers=0))
    assert len(note) == 1 and "model.mtp_layers = 0" in note[0], note
    assert "tensors (model.layers.3." in note[0]
    assert hf_load_notes(folder, _config(str(tmp_path), "x", str(folder), {})) == []
    for mtp_layers in (0, 1):
        launch_dims(_config(str(tmp_path), "x", str(folder), {}, mtp_layers=mtp_layers))
    for mtp_layers in (0, 1):  # start-up checks pass
        check_checkpoints(_config(str(tmp_path), "x", str(folder), {}, mtp_layers=mtp_layers))
    with pytest.raises(ConfigError, match=r"mtp_layers \(2 here, 1 there\)"):
        check_checkpoints(_config(str(tmp_path), "x", str(folder), {}, mtp_layers=2))


def test_a_copy_that_differs_is_refused(tmp_path):
    mtp_folder(tmp_path)
    cfg = _config(str(tmp_path), "x", str(tmp_path), {})
    check_shared_copies(cfg, tmp_path)  # DeepSeek's copies, equal: they load
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["model.layers.3.shared_head.head.weight"][5, 2] += 1.0
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(StartupError, match="'model.layers.3.shared_head.head.weight' differs"):
        check_shared_copies(cfg, tmp_path)


def _started(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str
) -> tuple[Config | None, str]:
    """``flexshard-train *args`` up to its spawn (not run): the config its ranks get, or
    None and the one line it exits with."""
    started: list[Config] = []
    monkeypatch.setattr(launch, "spawn", lambda cfg, dims, nproc: started.append(cfg))
    try:
        launch.main(list(args))
    except SystemExit as exit_info:
        assert "Traceback" not in "".join(capsys.readouterr())
        return None, str(exit_info.code)
    return started[0], ""


def test_layouts_without_mtp_leave_the_depths_out_unless_asked(tmp_path, monkeypatch, capsys):
    """pp, tp, cp and rl train no MTP: a folder's depths, model.mtp_layers not given, load
    left out there, the start-up line naming the layout and the export; given, refused."""
    mtp_folder(tmp_path / "hf")
    folder = str(tmp_path / "hf")
    pp = [
        "--nproc", "3", "--checkpoint.initial_load_path", folder,
        "--checkpoint.initial_load_in_hf", "true", "--parallelism.pp", "3",
        "--training.batch_size", "3", "--training.seq_len", "16",
        "--job.dump_folder", str(tmp_path / "out"),
    ]  # fmt: skip
    cfg, _ = _started(monkeypatch, capsys, *pp)
    assert cfg is not None and cfg.model.mtp_layers == 0
    (line,) = hf_load_notes(folder, cfg)  # what the load prints on rank 0
    assert "tensors (model.layers.3." in line and "not loaded: parallelism.pp = 3" in line
    assert "the export will not carry them (to keep them, train with" in line, line
    cfg, error = _started(monkeypatch, capsys, *pp, "--model.mtp_layers", "1")
    assert cfg is None and "model.mtp_layers = 1 runs with data" in error, error
    on_dp, _ = _started(monkeypatch, capsys, *pp[:6], "--job.dump_folder", str(tmp_path / "o"))
    assert on_dp is not None and on_dp.model.mtp_layers == 1  # the folder's, trained
    for key in ("tp", "cp"):
        assert load_config(overrides=[*pp[2:6], f"--parallelism.{key}", "2"]).model.mtp_layers == 0
        given = _config(str(tmp_path), "x", folder, {"dp_shard": 1, key: 2})  # [model] written
        with pytest.raises(ConfigError, match=r"model\.mtp_layers = 1 runs with data.*0 trains"):
            launch_dims(given)
    rl = load_config(overrides=[*pp[2:6], "--rl.enable", "true"])
    assert rl.model.mtp_layers == 0 and "rl.enable = true" in hf_load_notes(folder, rl)[0]


# ---------------------------------------------------------------- layouts
LAYOUTS: dict[str, tuple[int, dict]] = {
    "dp2_flat": (2, {"dp_shard": 2, "placement": "flat"}),
    "dp3_mixed": (3, {"dp_shard": 3, "placement": "mixed"}),
    # slow: the other placements
    "dp2_shard0": (2, {"dp_shard": 2}),
    "dp2_owned": (2, {"dp_shard": 2, "placement": "owned"}),
    "dp3_block": (3, {"dp_shard": 3, "placement": "block"}),
    "dp2xep2": (2, {"dp_shard": 2, "ep": 2}),
}
GLOBAL_BATCH = 6  # 2 and 3 ranks


def _config(
    root: str,
    name: str,
    folder: str,
    parallelism: dict,
    mtp_layers: int | None = None,
    **checkpoint: Any,
) -> Config:
    """[model] as the folder says (``--model.mtp_layers`` given: that)."""
    dp = parallelism.get("dp_shard", 1)
    model = folder_fields(folder)
    if mtp_layers is not None:
        model["mtp_layers"] = mtp_layers
    return tiny_config(
        f"{root}/{name}",
        model=model,
        parallelism=parallelism,
        training={"steps": STEPS, "batch_size": GLOBAL_BATCH // dp, "seq_len": 16, "lr": 3e-3},
        checkpoint={"initial_load_path": folder, "initial_load_in_hf": True, **checkpoint},
    )


def _layout(rank: int, world_size: int, root: str, names: list[str]) -> dict[str, Any]:
    out = {}
    for name in names:
        job = setup(_config(root, name, f"{root}/hf", LAYOUTS[name][1]))
        checkpointing.initial_load(job)
        export(job, Path(root) / name / "loaded")
        losses, norms = zip(*(train_step(job, step)[:2] for step in range(STEPS)))
        export(job, Path(root) / name / "trained")
        params = {k: v.numpy() for k, v in whole_parameters(job).items() if k.startswith("mtp.")}
        out[name] = {"losses": list(losses), "norms": list(norms), "mtp": params}
    return out


def single_process(root: str) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """One process from the same folder on the global batch: losses, gradient norms,
    the trained MTP depths."""
    cfg = _config(root, "one", f"{root}/hf", {"dp_shard": 1})
    t = cfg.training
    model = trainer_model(Path(root) / "hf")
    tokens = load_tokens(cfg.data, ByteTokenizer())
    sampler = DPSampler(tokens, t.seq_len, GLOBAL_BATCH, 1, 0, 1, t.seed)
    optimizer = build_optimizer(model, t, cfg.model)
    losses, norms = [], []
    for step in range(STEPS):
        set_lr(optimizer, step, t)
        inputs, targets = sampler.batch(step)
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), t.max_norm)))
        optimizer.step()
        step_balance([model])  # the selection biases, from the whole batch's loads
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses, norms, {k: v.detach() for k, v in model.state_dict().items() if "mtp." in k}


def _but_dtype(config: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in config.items() if k not in ("torch_dtype", "dtype")}


def _mtp_names(tensors: dict[str, torch.Tensor]) -> list[str]:
    return sorted(k for k in tensors if k.startswith(f"model.layers.{N_LAYERS}."))


def _check_layouts(tmp_path: Path, names: list[str], reload: bool = True) -> None:
    """``names`` trained; ``reload``: transformers loads the first one's export too."""
    mtp_folder(tmp_path / "hf")
    world_size = LAYOUTS[names[0]][0]
    results = run_distributed(_layout, world_size, str(tmp_path), names, timeout=900)
    losses, norms, trained = single_process(str(tmp_path))
    original = load_file(str(tmp_path / "hf" / "model.safetensors"))
    source = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert len(_mtp_names(original)) > 40  # the block, its experts, norms, copies
    for name in names:
        result = results[0][name]
        assert all(r[name]["losses"] == result["losses"] for r in results), name
        loss_gap = max(abs(a - b) / b for a, b in zip(result["losses"], losses))
        norm_gap = max(abs(a - b) / b for a, b in zip(result["norms"], norms))
        param_gap = max(
            float((torch.from_numpy(result["mtp"][k]) - v).abs().max())
            for k, v in trained.items()
            if k in result["mtp"]
        )
        print(f"{name}: loss {loss_gap:.2e} norm {norm_gap:.2e} mtp params {param_gap:.2e}")
        assert loss_gap < LOSS_RTOL and norm_gap < NORM_RTOL and param_gap < PARAM_ATOL
        # loaded and exported untrained: the folder as it came, bit for bit
        loaded = load_file(str(tmp_path / name / "loaded" / "model.safetensors"))
        assert set(loaded) == set(original), set(loaded) ^ set(original)
        assert [k for k, v in original.items() if not torch.equal(loaded[k], v)] == []
        config = json.loads((tmp_path / name / "loaded" / "config.json").read_text())
        assert config["num_nextn_predict_layers"] == 1
        assert _but_dtype(config) == _but_dtype(source)  # the config.json as it came
        # trained: the depths exported as they trained, the copies are the main ones
        exported = load_file(str(tmp_path / name / "trained" / "model.safetensors"))
        prefix = f"model.layers.{N_LAYERS}."
        for fqn, hf in (
            ("mtp.layers.0.eh_proj.weight", "eh_proj.weight"),
            ("mtp.layers.0.norm.weight", "shared_head.norm.weight"),
            ("mtp.layers.0.block.attention.q_b_proj.weight", "self_attn.q_b_proj.weight"),
        ):
            assert torch.equal(exported[prefix + hf], torch.from_numpy(result["mtp"][fqn]))
        assert not torch.equal(
            exported[prefix + "eh_proj.weight"], original[prefix + "eh_proj.weight"]
        )
        assert torch.equal(
            exported[prefix + "embed_tokens.weight"], exported["model.embed_tokens.weight"]
        )
        assert torch.equal(exported[prefix + "shared_head.head.weight"], exported["lm_head.weight"])
    if not reload:
        return
    # transformers loads the export as it loads the original: the depth's keys unexpected
    transformers = _transformers()
    infos = [
        transformers.DeepseekV3ForCausalLM.from_pretrained(path, output_loading_info=True)[1]
        for path in (tmp_path / "hf", tmp_path / names[0] / "trained")
    ]
    assert infos[0] == infos[1], infos
    unexpected = set(infos[0]["unexpected_keys"])  # under transformers' fused expert names
    assert "model.layers.3.eh_proj.weight" in unexpected
    assert all(k.startswith(f"model.layers.{N_LAYERS}.") for k in unexpected), unexpected
    assert not infos[0]["missing_keys"] and not infos[0]["mismatched_keys"]


def test_odd_world_on_3_ranks(tmp_path):
    _check_layouts(tmp_path, ["dp3_mixed"])


@pytest.mark.slow
def test_data_parallel_on_2_ranks(tmp_path):
    _check_layouts(tmp_path, ["dp2_flat"], reload=False)


@pytest.mark.slow
@pytest.mark.parametrize(
    "names", [["dp2_shard0", "dp2_owned", "dp2xep2"], ["dp3_block"]], ids=["w2", "w3"]
)
def test_the_other_placements(tmp_path, names):
    _check_layouts(tmp_path, names)


def _run_and_resume(rank: int, world_size: int, root: str) -> tuple[list[dict], list[dict]]:
    parallelism = {"dp_shard": world_size}
    checkpoint = {"enable": True, "interval": 5, "last_save_in_hf": True}
    cfg = _config(root, "run", f"{root}/hf", parallelism, **checkpoint)
    whole = run(cfg)
    ckpt = Path(cfg.job.dump_folder) / cfg.checkpoint.folder
    dist.barrier()
    if rank == 0:  # as if the job had died after the step-5 save
        shutil.rmtree(ckpt / f"step-{STEPS}")
    dist.barrier()
    return whole, run(cfg)


@pytest.mark.slow
def test_run_logs_mtp_loss_and_resumes_exactly(tmp_path):
    """``run``'s own path from the folder at W = 2: the MTP loss logged and falling; a
    resume from the step-5 checkpoint (the depths in it) repeats steps 6-10 bit for bit."""
    mtp_folder(tmp_path / "hf")
    whole, resumed = run_distributed(_run_and_resume, 2, str(tmp_path), timeout=900)[0]
    mtp = [r["mtp_loss"] for r in whole]
    assert mtp[-1] < mtp[0], mtp
    assert [r["step"] for r in resumed] == list(range(6, STEPS + 1))
    for key in ("loss", "mtp_loss"):
        assert [r[key] for r in resumed] == [r[key] for r in whole[5:]], key
    exported = load_file(str(tmp_path / "run" / "hf" / "model.safetensors"))
    assert f"model.layers.{N_LAYERS}.eh_proj.weight" in exported
