"""What can fail before the first step, checked before any rank starts (or, under
torchrun, before a rank joins the process group): device, tokenizer, data, the
checkpoint to resume or start from (its tensors' shapes against the config), and the
dump folder (writable, with room for one checkpoint). Each failure is a
``StartupError`` that ``flexshard-train`` prints as one line naming the file, key or
path; no rank has to start for it."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from ..config import Config, ConfigError
from ..config.hf_config import check_matches
from ..config.tokenizer import load_tokenizer
from ..data.dataset import data_files

# what a checkpoint stores per parameter, in fp32 elements: the weight and the
# optimizer's two moments (AdamW; Muon keeps fewer, SOAP / Shampoo more), as the
# planner counts optimizer state (flexshard/plan/memory.py)
CHECKPOINT_SLOTS = 3
FP32_BYTES = 4


class StartupError(ConfigError):
    """A problem found before training: ``what`` says of which kind (the line's label)."""

    def __init__(self, what: str, message: str) -> None:
        super().__init__(message)
        self.what = what


def check_before_start(cfg: Config, local_ranks: int) -> None:
    """Every check that needs no process group; ``local_ranks``: ranks on this machine."""
    check_device(cfg, local_ranks)
    load_tokenizer(cfg.model)  # opens the file; a vocab_size too small is named
    check_data(cfg)
    check_checkpoints(cfg)
    check_dump_folder(cfg)


def check_device(cfg: Config, local_ranks: int) -> None:
    if cfg.training.device != "cuda":
        return
    if not torch.cuda.is_available():
        raise StartupError(
            "device",
            'training.device = "cuda": no CUDA device on this machine (use "cpu" or "auto")',
        )
    if torch.cuda.device_count() < local_ranks:
        raise StartupError(
            "device",
            f'training.device = "cuda": {local_ranks} ranks on this machine but '
            f"{torch.cuda.device_count()} CUDA devices",
        )


def check_data(cfg: Config) -> None:
    d = cfg.data
    if d.source == "files":
        data_files(d.paths)
    elif d.source == "hf_disk":
        folder = Path(d.hf_path)
        saved = ("dataset_info.json", "dataset_dict.json", "state.json")
        if not folder.is_dir() or not any((folder / name).is_file() for name in saved):
            raise StartupError(
                "data", f"data.hf_path '{d.hf_path}': not a datasets.save_to_disk folder"
            )


def resume_path(cfg: Config) -> Path | None:
    """The checkpoint the run will resume from: the latest complete one, if resuming."""
    from .checkpoints import latest_step

    c = cfg.checkpoint
    root = Path(cfg.job.dump_folder) / c.folder
    step = latest_step(root) if c.enable and c.resume else None
    return None if step is None else root / f"step-{step}"


def check_checkpoints(cfg: Config) -> None:
    """The checkpoint the run will load, if any: the latest one to resume, else
    ``initial_load_path``; its model tensors must have the shapes the config builds."""
    c = cfg.checkpoint
    resume = resume_path(cfg)
    if resume is not None:
        fix = (
            "resume with the config it was written with, or start afresh "
            "(--checkpoint.resume false or another checkpoint.folder)"
        )
        check_checkpoint_shapes(cfg, resume, fix)
    elif c.initial_load_path:
        path = Path(c.initial_load_path)
        key = "checkpoint.initial_load_path"
        if not path.exists():
            raise StartupError("checkpoint", f"{key} '{path}': no such file or folder")
        if c.initial_load_in_hf:
            check_matches(cfg.model, path)  # config.json against [model], keys named
            if not any(path.glob("*.safetensors")):
                raise StartupError("checkpoint", f"{key} '{path}': no *.safetensors file")
            check_hf_files(path)
            check_shared_copies(cfg, path)
        elif not (path / ".metadata").is_file():
            raise StartupError(
                "checkpoint",
                f"{key} '{path}': not a DCP checkpoint folder (no .metadata); a Hugging "
                "Face folder needs checkpoint.initial_load_in_hf = true",
            )
        else:
            fix = "give [model] the sizes it was written with"
            check_checkpoint_shapes(cfg, path, fix)


def check_hf_files(path: Path) -> None:
    """A Hugging Face folder's safetensors files whole (a truncated download, a file of
    something else): a StartupError naming the file, before any rank reads it."""
    from flexshard.checkpoint.hf_safetensors import check_safetensors_folder

    try:
        check_safetensors_folder(path)
    except ValueError as err:
        raise StartupError("checkpoint", str(err)) from None


COPY_ROWS = 4096  # rows compared at a time: a 129k-row embedding is never read whole


def check_shared_copies(cfg: Config, path: Path) -> None:
    """The MTP depths' copies of the embedding and head in a DeepSeek-V3 folder
    (``models.hf_adapter.shared_copies``) equal the main model's bit for bit: the run
    shares one tensor between them, so a copy that differs would be dropped unseen.
    A StartupError names the first that differs; a folder without copies passes."""
    from safetensors import safe_open

    from flexshard.checkpoint.hf_safetensors import stored_tensors

    from ..config.hf_config import folder_fields
    from ..models.hf_adapter import hf_keys, shared_copies

    copies = shared_copies(cfg.model)
    if not copies:
        return
    stored = stored_tensors(path)
    tied = folder_fields(path)["tie_embeddings"]
    mains = hf_keys(sorted(set(copies.values())), cfg.model, tied)
    for name, fqn in copies.items():
        main = mains[fqn].name
        if name not in stored:
            continue
        with (
            safe_open(stored[name].file, "pt") as copy_file,
            safe_open(stored[main].file, "pt") as main_file,
        ):
            copy, whole = copy_file.get_slice(name), main_file.get_slice(main)
            same = copy.get_shape() == whole.get_shape() and all(
                torch.equal(copy[i : i + COPY_ROWS], whole[i : i + COPY_ROWS])
                for i in range(0, copy.get_shape()[0], COPY_ROWS)
            )
        if not same:
            raise StartupError(
                "checkpoint",
                f"checkpoint.initial_load_path '{path}': '{name}' differs from '{main}': "
                "the trainer's MTP depths share the main model's embedding and head (as "
                "DeepSeek trains them); set --model.mtp_layers 0 to leave the depths out",
            )


def model_shapes(cfg: Config) -> dict[str, torch.Size]:
    """Every parameter's whole shape, by FQN, from a model built on meta (no memory)."""
    from ..models.model import meta_model

    return {fqn: p.shape for fqn, p in meta_model(cfg.model).named_parameters()}


def check_checkpoint_shapes(cfg: Config, path: Path, fix: str) -> None:
    """The DCP checkpoint's ``model.*`` tensors against the config's parameters;
    ``fix``: what the user can do about a mismatch."""
    from flexshard.checkpoint.safe_load import read_metadata

    try:
        saved = read_metadata(path).state_dict_metadata
    except ValueError as err:  # not DCP metadata, or a type loading may not build: named
        raise StartupError("checkpoint", str(err)) from None
    except OSError as err:
        raise StartupError("checkpoint", f"'{path / '.metadata'}': unreadable ({err})") from None
    wrong = []
    for fqn, shape in model_shapes(cfg).items():
        entry = saved.get(f"model.{fqn}")
        size = getattr(entry, "size", None)
        if entry is None:
            wrong.append(f"no tensor 'model.{fqn}'")
        elif size is not None and tuple(size) != tuple(shape):
            wrong.append(f"'model.{fqn}' is {tuple(size)}, the config builds {tuple(shape)}")
    if wrong:
        more = f" (and {len(wrong) - 3} more)" if len(wrong) > 3 else ""
        raise StartupError(
            "checkpoint",
            f"'{path}' does not fit [model]: {'; '.join(wrong[:3])}{more}; {fix}",
        )


def checkpoint_bytes(cfg: Config) -> int:
    """About what one checkpoint takes on disk: fp32 weights and optimizer moments."""
    numel = sum(shape.numel() for shape in model_shapes(cfg).values())
    return numel * FP32_BYTES * CHECKPOINT_SLOTS


def _existing_ancestor(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def _check_writable(path: Path, key: str) -> Path:
    """``path`` (or the folder it would be made in) is a writable folder; that folder."""
    base = _existing_ancestor(path)
    if not base.is_dir():
        raise StartupError("folder", f"{key} '{path}': '{base}' is a file, not a folder")
    try:  # a real write: os.access says yes to root on a read-only file system
        with tempfile.TemporaryFile(dir=base):
            pass
    except OSError as err:
        raise StartupError("folder", f"{key} '{path}': cannot write in '{base}' ({err})") from None
    return base


def check_dump_folder(cfg: Config) -> None:
    """The dump folder (metrics, exports) and, with checkpoints on, the checkpoint
    folder: writable, and room on its file system for one more checkpoint."""
    dump = Path(cfg.job.dump_folder)
    _check_writable(dump, "job.dump_folder")
    c = cfg.checkpoint
    if not c.enable:
        return
    folder = dump / c.folder
    base = _check_writable(folder, "checkpoint.folder")
    free, need = shutil.disk_usage(base).free, checkpoint_bytes(cfg)
    if free < need:
        raise StartupError(
            "disk",
            f"checkpoint.folder '{folder}': {_gib(free)} free on its file system, one "
            f"checkpoint needs about {_gib(need)} (fp32 weights and optimizer state)",
        )


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


@contextlib.contextmanager
def load_errors(cfg: Config) -> Iterator[None]:
    """A checkpoint that passed the checks above and still does not load (a shape the
    metadata did not show, optimizer state of another kind): a StartupError naming it
    with the loader's message, instead of a traceback per rank. DCP raises a
    CheckpointException carrying every rank's failure."""
    from torch.distributed.checkpoint import CheckpointException

    try:
        yield
    except ConfigError:
        raise
    except ValueError as err:  # flexshard.checkpoint's messages name the folder
        raise StartupError("checkpoint", str(err)) from err
    except CheckpointException as err:
        path = resume_path(cfg) or cfg.checkpoint.initial_load_path
        rank, (exc, _) = min(err.failures.items(), key=lambda item: item[0])
        message = f"'{path}': loading failed on rank {rank}: {type(exc).__name__}: {exc}"
        raise StartupError("checkpoint", message) from None
