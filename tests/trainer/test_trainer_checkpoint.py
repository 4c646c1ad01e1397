"""Trainer checkpoints: a resumed run continues with exactly the losses of an
uninterrupted one (flexshard and FSDP2 backends), a checkpoint loads under another
world size and placement, and the final model exports to safetensors."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor

import flexshard as fs
from flexshard.checkpoint.safe_load import read_metadata
from flexshard.testing import run_distributed
from flexshard.trainer.checkpointing import checkpoints as checkpointing
from flexshard.trainer.checkpointing.checkpoints import latest_step
from flexshard.trainer.models.model import Transformer, init_weights
from flexshard.trainer.train import run

from ..helpers.trainer_cases import single_process_run, tiny_config

STEPS = 6
CKPT = {"enable": True, "interval": 3}
#: exported vs single-process parameters after STEPS steps: worst measured 4.2e-6
#: (output.weight), while every tensor moved at least 9e-3 from its initial value
EXPORT_ATOL = 1e-4


def _losses(records: list[dict]) -> list[float]:
    return [r["loss"] for r in records]


def _gathered(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole trained model: flexshard's gathered state, or FSDP2's DTensors made full."""
    if isinstance(model, fs.FlexShardModule):
        return fs.full_state_dict(model)
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in model.state_dict().items()
    }


def _keep_trained(folder: str) -> None:
    """Wrap the trainer's export: just before it writes model.safetensors, the gathered
    parameters are saved (rank 0) to ``trained.pt``, for the parent to compare with."""
    real = checkpointing.export

    def export(job, *args, **kwargs):
        trained = _gathered(job.model)
        if dist.get_rank() == 0:
            torch.save(trained, f"{folder}/trained.pt")
        return real(job, *args, **kwargs)

    checkpointing.export = export


def _interrupted(rank: int, world_size: int, folder: str) -> dict[str, tuple]:
    out = {}
    for backend in ("flexshard", "fsdp2"):
        _keep_trained(f"{folder}/{backend}")
        cfg = tiny_config(
            f"{folder}/{backend}",
            training={"steps": STEPS, "batch_size": 3},
            parallelism={"dp_backend": backend},
            checkpoint={**CKPT, "export_safetensors": True},
        )
        whole = run(cfg)
        ckpt = Path(cfg.job.dump_folder) / cfg.checkpoint.folder
        saved = latest_step(ckpt)
        dist.barrier()
        if rank == 0:  # as if the job had died after the step-3 save
            shutil.rmtree(ckpt / f"step-{STEPS}")
        dist.barrier()
        resumed = run(cfg)
        out[backend] = (_losses(whole), [r["step"] for r in resumed], _losses(resumed), saved)
    return out


def _other_world(rank: int, world_size: int, folder: str) -> list[float]:
    """Resume the W = 2 Shard(0) checkpoint at W = 3 with Owned buckets; same global batch."""
    cfg = tiny_config(
        f"{folder}/flexshard",
        training={"steps": STEPS, "batch_size": 2},
        parallelism={"placement": "owned"},
        checkpoint=CKPT,
    )
    return _losses(run(cfg))


def test_resume_is_exact_and_reshardable(tmp_path):
    results = run_distributed(_interrupted, 2, str(tmp_path), timeout=600)
    for rank, by_backend in enumerate(results):
        for backend, (whole, resumed_steps, resumed, saved) in by_backend.items():
            assert saved == STEPS, backend
            assert resumed_steps == [4, 5, 6], (backend, rank)
            assert resumed == whole[3:], (backend, rank)  # bit for bit
    whole = results[0]["flexshard"][0]

    shutil.rmtree(tmp_path / "flexshard" / "checkpoint" / f"step-{STEPS}")  # back to step 3
    other = run_distributed(_other_world, 3, str(tmp_path), timeout=600)
    for losses in other:
        assert len(losses) == 3
        gaps = [abs(a - b) / b for a, b in zip(losses, whole[3:])]
        assert max(gaps) < 2e-5, gaps

    # the exported model: every parameter, full shape, the trained (not initial) values
    cfg = tiny_config("-", training={"steps": STEPS, "batch_size": 3})
    initial = Transformer(cfg.model)
    init_weights(initial, cfg.training.seed)
    initial = initial.state_dict()
    reference = single_process_run(cfg, dp_size=2)[1]
    for backend in ("flexshard", "fsdp2"):
        exported = load_file(str(tmp_path / backend / "model.safetensors"))
        trained = torch.load(tmp_path / backend / "trained.pt")
        assert {k: v.shape for k, v in exported.items()} == {
            k: v.shape for k, v in initial.items()
        }, backend
        # bit for bit the parameters gathered at the end of training ...
        assert [k for k in exported if not torch.equal(exported[k], trained[k])] == [], backend
        # ... which are not the initial ones: every tensor moved, by far more than the
        # gap to an independent single-process run of the same training
        for key, value in exported.items():
            moved = (value - initial[key]).abs().max().item()
            gap = (value - reference[key]).abs().max().item()
            assert gap < EXPORT_ATOL < moved / 10, (backend, key, gap, moved)
    flex = load_file(str(tmp_path / "flexshard" / "model.safetensors"))
    fsdp2 = load_file(str(tmp_path / "fsdp2" / "model.safetensors"))
    assert all(torch.allclose(flex[k], fsdp2[k], atol=1e-5) for k in flex)


def _scheduler_saved(rank: int, world_size: int, folder: str) -> dict:
    """A run saving step 3, and one whose step-3 save held no scheduler state (as if
    ``_entries`` left it out), resumed with more steps."""
    out: dict = {}
    for name, entries in (("kept", checkpointing._entries), ("dropped", lambda job: {})):
        cfg = tiny_config(f"{folder}/{name}", training={"steps": 3}, checkpoint=CKPT)
        real, checkpointing._entries = checkpointing._entries, entries
        try:
            run(cfg)
        finally:
            checkpointing._entries = real
        longer = tiny_config(f"{folder}/{name}", training={"steps": 4}, checkpoint=CKPT)
        try:
            out[name] = [r["step"] for r in run(longer)]
        except Exception as err:
            out[name] = f"{type(err).__name__}: {err}"
    return out


def test_scheduler_state_is_saved_once_and_required_on_resume(tmp_path):
    results = run_distributed(_scheduler_saved, 2, str(tmp_path), timeout=300)
    step = tmp_path / "kept" / "checkpoint" / "step-3"
    saved = read_metadata(step).state_dict_metadata
    assert any(key.startswith("lr_scheduler.") for key in saved)  # the DCP entry ...
    for extra in step.glob("extra_*.pt"):  # ... and no second copy in the per-rank extras
        assert set(torch.load(extra)) == {"step"}, extra
    for rank, out in enumerate(results):
        assert out["kept"] == [4], rank
        error = out["dropped"]
        assert isinstance(error, str) and "\n" not in error, (rank, error)
        assert f"{tmp_path / 'dropped' / 'checkpoint' / 'step-3'}" in error, error
        assert "holds no 'lr_scheduler' state" in error, error


def test_resume_refuses_a_mismatched_lr_scheduler_state():
    import pytest

    with pytest.raises(ValueError, match="at step 2, the checkpoint at step 3"):
        checkpointing._restore_schedule(None, {"last_epoch": 2}, 3, Path("ckpt/step-3"))  # type: ignore[arg-type]


def _warned(rank: int, world_size: int, folder: str) -> list[str]:
    """Both backends: train, save, resume and export with every warning an error."""
    import warnings

    out = []
    for backend in ("flexshard", "fsdp2"):
        for steps in (2, 3):
            cfg = tiny_config(
                f"{folder}/{backend}",
                training={"steps": steps},
                parallelism={"dp_backend": backend},
                checkpoint={**CKPT, "interval": 2, "export_safetensors": True},
            )
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                try:
                    run(cfg)
                except Warning as warning:
                    out.append(f"{backend}: {type(warning).__name__}: {warning}")
    return out


def test_training_saving_and_resuming_warn_nothing(tmp_path):
    assert run_distributed(_warned, 2, str(tmp_path), timeout=300) == [[], []]
