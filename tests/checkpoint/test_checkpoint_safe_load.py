"""Loading a checkpoint runs no code from it, on every path that opens one.

A planted checkpoint is a real one with a pickle swapped in whose unpickling creates a
marker file (and returns the original value, so a load that runs it goes on as if
nothing happened), its manifest rewritten to agree: the manifest proves integrity,
not authorship. Every load of it must raise an UnsafeCheckpointError (the trainer: a
one-line StartupError) naming the file and the planted global, with the marker not
created. What flexshard, the trainer and torch's own ``dcp.save`` write loads as
torch's own reader reads it.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import flexshard as fs
from flexshard import checkpoint as ckpt
from flexshard.checkpoint.async_save import AsyncCheckpointer
from flexshard.checkpoint.manifest import MANIFEST, Entry, digest, read_manifest, write_manifest
from flexshard.checkpoint.safe_load import (
    UnsafeCheckpointError,
    load_data,
    read_metadata,
    read_metadata_file,
)
from flexshard.optim import MatrixState
from flexshard.testing import TinyTransformer, TransformerConfig, make_batches, run_distributed

ROOT = Path(__file__).resolve().parents[2]
DEBUG = str(ROOT / "configs" / "debug.toml")
QUIET = ["--job.tensorboard", "false", "--job.plot", "false", "--job.progress", "false"]


# ------------------------------------------------------------------ planting
def planted_code(marker: str, value: Any = None) -> Any:
    """What a planted pickle calls: creates ``marker``, returns ``value``."""
    with open(marker, "w"):
        pass
    return value


PLANTED = f"{planted_code.__module__}.{planted_code.__qualname__}"


class Payload:
    """Pickles as a call of ``planted_code(marker, value)``."""

    def __init__(self, marker: str, value: Any = None) -> None:
        self.marker, self.value = marker, value

    def __reduce__(self) -> tuple:
        return planted_code, (self.marker, self.value)


def _reseal(root: str, moved: dict[str, tuple[int, int]] | None = None) -> None:
    """The manifest made to agree with the files (``moved``: key -> new offset, length)."""
    if not os.path.isfile(os.path.join(root, MANIFEST)):
        return
    entries, _, world = read_manifest(root)
    moved = moved or {}
    entries = [Entry(e.key, e.file, *moved[e.key]) if e.key in moved else e for e in entries]
    write_manifest(root, entries, {e.key: digest(root, e) for e in entries}, world)  # type: ignore[misc]


def _write_metadata(root: str, metadata: Any) -> None:
    with open(os.path.join(root, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)


def plant_metadata(root: str, marker: str) -> str:
    """``.metadata``: the real metadata with one more attribute, the payload."""
    metadata = read_metadata(root)
    metadata.note = Payload(marker)  # type: ignore[attr-defined]
    _write_metadata(root, metadata)
    _reseal(root)
    return ".metadata"


def plant_entry(root: str, key: str, marker: str, inside: bool = False) -> str:
    """Non-tensor entry ``key``: the payload returning the saved value (``inside``: the
    saved MatrixState with the payload among its state) appended to its file, the
    metadata pointed at it."""
    metadata = read_metadata(root)
    index = next(i for i in metadata.storage_data if i.fqn == key)
    info = metadata.storage_data[index]
    path = os.path.join(root, info.relative_path)
    with open(path, "rb") as f:
        f.seek(info.offset)
        saved = load_data(io.BytesIO(f.read(info.length)), key)
    if inside:
        saved.state["note"] = Payload(marker)
        value: Any = saved
    else:
        value = Payload(marker, saved)
    buffer = io.BytesIO()
    torch.save(value, buffer)
    offset = os.path.getsize(path)
    with open(path, "ab") as f:
        f.write(buffer.getvalue())
    metadata.storage_data[index] = dataclasses.replace(
        info, offset=offset, length=len(buffer.getvalue())
    )
    _write_metadata(root, metadata)
    _reseal(root, {key: (offset, len(buffer.getvalue()))})
    return info.relative_path


def plant_extras(root: str, marker: str) -> str:
    """Every rank's extra file: its saved dict with the payload added."""
    for name in sorted(os.listdir(root)):
        if name.startswith("extra_"):
            path = os.path.join(root, name)
            extra = load_data(path, path)
            torch.save({**extra, "note": Payload(marker)}, path)
    _reseal(root)
    return "extra_{rank}.pt"


def _planted_copy(good: str, folder: str, plant: Any) -> tuple[str, str]:
    """A planted copy of ``good`` at ``folder`` (rank 0 makes it): the planted file
    (this rank's) and the marker."""
    marker, file = f"{folder}.marker", [""]
    if dist.get_rank() == 0:
        shutil.copytree(good, folder)
        file[0] = plant(folder, marker)
    dist.broadcast_object_list(file, src=0)
    return f"{folder}/{file[0].format(rank=dist.get_rank())}", marker


def _attempt(call: Any) -> tuple[str | None, str]:
    try:
        call()
    except Exception as err:  # recorded for the parent to check
        return type(err).__name__, str(err)
    return None, "no error"


def _check(outcome: tuple, planted: str = PLANTED) -> None:
    """Refused with one line naming the planted file and global; the marker not made."""
    kind, message, marked, file = outcome[:4]
    assert not marked, f"the planted code ran: {message}"
    assert kind in ("UnsafeCheckpointError", "StartupError"), f"{kind}: {message}"
    assert "\n" not in message, message
    assert f"'{file}'" in message and f"'{planted}'" in message, message


# ------------------------------------------------------------------ fs.checkpoint
def _mixed(fqn: str, param: torch.Tensor) -> fs.Placement:
    """Every placement kind in one checkpoint: flat ranges, whole Owned, Shard(0) rows."""
    if param.ndim < 2:
        return fs.FlatShard()
    return fs.Owned() if "up" in fqn else fs.Shard(0)


BUCKETS = [fs.BucketSpec("*", placement=_mixed)]


def _model(mesh, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = fs.flex_shard(TinyTransformer(TransformerConfig()), mesh=mesh, buckets=BUCKETS)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens, targets = make_batches(model.cfg, 1, batch=2)[0]
    model.loss(tokens, targets).backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _values(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    values = [p.detach().clone() for p in model.parameters()]
    return values + [v.clone() for s in opt.state.values() for v in s.values()]


def _unchanged(before: list[torch.Tensor], model, opt) -> bool:
    return all(torch.equal(a, b) for a, b in zip(before, _values(model, opt), strict=True))


def _library_cases() -> dict[str, tuple[str, Any]]:
    """case -> (which good checkpoint, how it is planted)."""
    return {
        "load .metadata": ("sync", plant_metadata),
        "load optimizer entry": ("sync", lambda r, m: plant_entry(r, "optim.param_groups.0.lr", m)),
        "load extras": ("sync", plant_extras),
        "load async-saved .metadata": ("async", plant_metadata),
        "load async-saved entry": (
            "async",
            lambda r, m: plant_entry(r, "optim.param_groups.0.eps", m),
        ),
        "load without manifest (torch's dcp.save)": ("dcp", plant_metadata),
        "load_state .metadata": ("state", plant_metadata),
        "load_state entry": ("state", lambda r, m: plant_entry(r, "note.epoch", m)),
        "load_state inside a MatrixState": (
            "state",
            lambda r, m: plant_entry(r, "matrix", m, inside=True),
        ),
    }


def _library(rank: int, world: int, root: str) -> dict[str, tuple]:
    mesh = init_device_mesh("cpu", (world,))
    model, opt = _model(mesh)
    ckpt.save(f"{root}/sync", model, opt, extra={"step": 3, "rng": torch.get_rng_state()})
    saver = AsyncCheckpointer("async")
    saver.save(f"{root}/async", saver.state(model, opt, None), label="async", extra={"step": 3})
    saver.close()
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=f"{root}/dcp")
    matrix = MatrixState({"exp_avg": torch.ones(2, 3), "step": 4})
    state = {"model": model.state_dict(), "note": {"epoch": 3}, "matrix": matrix}
    ckpt.save_state(f"{root}/state", state)
    out = {}
    for case, (good, plant) in _library_cases().items():
        folder = f"{root}/{case.replace(' ', '_')}"
        file, marker = _planted_copy(f"{root}/{good}", folder, plant)
        fresh, fresh_opt = _model(mesh, seed=1)
        before = _values(fresh, fresh_opt)
        # the extras as torch.load without weights_only would read them under this setting
        os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = "1" if case == "load extras" else "0"
        if good == "state":  # loads in place: what it read before the refusal stays
            target = {"model": fresh.state_dict(), "note": {"epoch": 0}, "matrix": None}
            kind, message = _attempt(lambda: ckpt.load_state(folder, target))  # noqa: B023
        elif good == "dcp":
            kind, message = _attempt(lambda: ckpt.load(folder, fresh, require_manifest=False))  # noqa: B023
        else:
            kind, message = _attempt(lambda: ckpt.load(folder, fresh, fresh_opt))  # noqa: B023
        dist.barrier()
        unchanged = good == "state" or _unchanged(before, fresh, fresh_opt)
        out[case] = (kind, message, os.path.exists(marker), file, unchanged)
    return out


@pytest.fixture(scope="module")
def library(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    root = os.fspath(tmp_path_factory.mktemp("planted"))
    return run_distributed(_library, 2, root, timeout=300)


@pytest.mark.parametrize("case", list(_library_cases()))
def test_planted_checkpoint_is_refused_by_fs_checkpoint(library, case: str) -> None:
    for rank, results in enumerate(library):
        _check(results[case])
        assert results[case][0] == "UnsafeCheckpointError", f"rank {rank}"
        assert results[case][4], f"rank {rank}: {case} changed the model or optimizer"


# ------------------------------------------------------------------ the trainer
def _trainer_cfg(folder: str, *more: str):
    from flexshard.trainer.config import load_config

    overrides = ["--training.steps", "2", "--training.batch_size", "2", "--training.seq_len", "32"]
    return load_config(DEBUG, [*overrides, "--job.dump_folder", folder, *QUIET, *more])


def _trainer_cases() -> dict[str, Any]:
    """case -> how its copy of step-2 is planted."""
    return {
        "resume .metadata": plant_metadata,
        "resume optimizer entry": lambda r, m: plant_entry(r, "optim.param_groups.0.lr", m),
        "resume extras": plant_extras,
        "initial_load_path .metadata": plant_metadata,
    }


def _trainer(rank: int, world: int, root: str) -> dict[str, tuple]:
    from flexshard.trainer.train import run

    run(_trainer_cfg(f"{root}/run", "--checkpoint.enable", "true", "--checkpoint.interval", "2"))
    out = {}
    for case, plant in _trainer_cases().items():
        name = case.replace(" ", "_")
        step = f"{root}/{name}/checkpoint/step-2"
        file, marker = _planted_copy(f"{root}/run/checkpoint/step-2", step, plant)
        if case.startswith("resume"):
            cfg = _trainer_cfg(f"{root}/{name}", "--checkpoint.enable", "true")
        else:
            cfg = _trainer_cfg(f"{root}/{name}_fresh", "--checkpoint.initial_load_path", step)
        os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = "1" if case == "resume extras" else "0"
        kind, message = _attempt(lambda: run(cfg))  # noqa: B023
        dist.barrier()
        out[case] = (kind, message, os.path.exists(marker), file)
    return out


@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict]]:
    root = os.fspath(tmp_path_factory.mktemp("trainer"))
    return root, run_distributed(_trainer, 2, root, timeout=300)


@pytest.mark.parametrize("case", list(_trainer_cases()))
def test_planted_checkpoint_is_refused_by_the_trainer_ranks(trainer, case: str) -> None:
    for rank, results in enumerate(trainer[1]):
        _check(results[case])
        assert results[case][0] == "StartupError", f"rank {rank}"


@pytest.fixture
def no_spawn(monkeypatch: pytest.MonkeyPatch) -> None:
    from flexshard.trainer import launch

    def spawn(*_: object) -> None:
        raise AssertionError("a rank was spawned before the error was found")

    monkeypatch.setattr(launch, "spawn", spawn)


def test_planted_checkpoint_is_refused_before_the_trainer_starts(trainer, tmp_path, no_spawn):
    """``flexshard-train``'s start-up checks read the metadata (shapes against the
    config) before any rank starts: resuming, and from ``initial_load_path``."""
    from flexshard.trainer import launch

    root, _ = trainer
    shutil.copytree(f"{root}/run", tmp_path / "run")
    step = tmp_path / "run" / "checkpoint" / "step-2"
    marker = tmp_path / "marker"
    plant_metadata(str(step), str(marker))
    common = ["--nproc", "2", "--config", DEBUG, *QUIET]
    for more in (
        ["--job.dump_folder", str(tmp_path / "run"), "--checkpoint.enable", "true"],
        ["--job.dump_folder", str(tmp_path / "new"), "--checkpoint.initial_load_path", str(step)],
    ):
        line = _exit_line(launch.main, [*common, *more])
        _check(("StartupError", line, marker.exists(), f"{step}/.metadata"))
        assert line.startswith("flexshard-train: checkpoint: refusing to load "), line


def _exit_line(main: Any, argv: list[str]) -> str:
    """The line a command-line entry point exits with (what stopped it otherwise)."""
    try:
        main(argv)
    except SystemExit as exit_info:
        return str(exit_info.code)
    except AssertionError as err:  # no_spawn: a rank would have started
        return str(err)
    return "no error"


def test_planted_checkpoint_is_refused_by_generate(trainer, tmp_path, capsys):
    """``flexshard-generate --checkpoint <step folder>``: the clean step generates, the
    planted one is refused in one line."""
    from flexshard.trainer import generate

    root, _ = trainer
    clean = f"{root}/run/checkpoint/step-2"
    args = ["--config", DEBUG, "--prompt", "Hi", "--max-new-tokens", "2"]
    generate.main(["--checkpoint", clean, *args])
    assert capsys.readouterr().out.strip()
    step = tmp_path / "step-2"
    shutil.copytree(clean, step)
    plant_metadata(str(step), str(tmp_path / "marker"))
    line = _exit_line(generate.main, ["--checkpoint", str(step), *args])
    _check(("UnsafeCheckpointError", line, (tmp_path / "marker").exists(), f"{step}/.metadata"))
    assert line.startswith("flexshard-generate: refusing to load "), line


# ------------------------------------------------------------------ the allow-list
@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_metadata_refuses_a_global_at_every_pickle_protocol(tmp_path, protocol: int) -> None:
    """GLOBAL (protocols 0-3) and STACK_GLOBAL (4, 5) both reach the allow-list; the
    name is refused before the call."""
    marker = tmp_path / "marker"
    data = pickle.dumps({"planted": Payload(str(marker))}, protocol=protocol)
    with pytest.raises(UnsafeCheckpointError, match=f"'{PLANTED}'"):
        read_metadata_file(io.BytesIO(data), "x/.metadata")
    assert not marker.exists()
    data = pickle.dumps({"system": os.system}, protocol=protocol)
    with pytest.raises(UnsafeCheckpointError, match=f"'{os.system.__module__}.system'"):
        read_metadata_file(io.BytesIO(data), "x/.metadata")


def test_metadata_cannot_set_attributes_of_an_allowed_class() -> None:
    """BUILD on an allowed class itself (not an instance) would change that class for the
    whole process: refused, the class untouched."""
    from torch.distributed.checkpoint.metadata import Metadata

    # GLOBAL Metadata, then (None, {"__doc__": "planted"}) as its state: BUILD
    data = (
        b"\x80\x02ctorch.distributed.checkpoint.metadata\nMetadata\n"
        + pickle.dumps((None, {"__doc__": "planted"}), protocol=2)[2:-1]
        + b"b."
    )
    before = Metadata.__doc__
    with pytest.raises(UnsafeCheckpointError, match="attributes of .*Metadata"):
        read_metadata_file(io.BytesIO(data), "x/.metadata")
    assert Metadata.__doc__ == before


def test_not_metadata_is_named(tmp_path) -> None:
    with pytest.raises(ValueError, match="'x/.metadata' holds a list, not DCP metadata"):
        read_metadata_file(io.BytesIO(pickle.dumps([1])), "x/.metadata")
    with pytest.raises(ValueError, match="'x/.metadata' is not a readable DCP .metadata file"):
        read_metadata_file(io.BytesIO(b"\x80\x04garbage"), "x/.metadata")


@dataclasses.dataclass
class Custom:
    """A type of the user's own, in a state entry."""

    value: int


def test_matrix_state_loads_under_each_module_path_it_was_saved_under() -> None:
    """A MatrixOptimizer state saved when its type lived in another module loads."""
    from flexshard.checkpoint.safe_load import load_data

    value = {"s": fs.optim.MatrixState({"exp_avg": torch.arange(3.0)})}
    buf = io.BytesIO()
    torch.save(value, buf)
    module = fs.optim.MatrixState.__module__.encode()
    for earlier in (module, b"flexshard.optim.matrix_units"):
        saved = _renamed_in_pickle(buf.getvalue(), module, earlier)
        loaded = load_data(io.BytesIO(saved), "old.distcp")
        assert torch.equal(loaded["s"].state["exp_avg"], torch.arange(3.0))


def _renamed_in_pickle(raw: bytes, old: bytes, new: bytes) -> bytes:
    """A ``torch.save`` zip whose pickle names module ``new`` where it named ``old``."""
    import zipfile

    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(raw)) as zin, zipfile.ZipFile(out, "w") as zout:
        for item in zin.infolist():
            data = zin.read(item.filename)
            if item.filename.endswith("data.pkl"):
                data = data.replace(old, new)
            zout.writestr(item, data)
    return out.getvalue()


def test_a_users_own_type_loads_once_allowed_through_torch(tmp_path) -> None:
    """Entries go through torch's weights_only unpickler: a type the user allows with
    ``torch.serialization.safe_globals`` / ``add_safe_globals`` loads, no other."""
    ckpt.save_state(tmp_path / "c", {"w": torch.ones(2), "custom": Custom(3)})
    target: dict[str, Any] = {"w": torch.zeros(2), "custom": None}
    with pytest.raises(UnsafeCheckpointError, match=f"'{Custom.__module__}.Custom'"):
        ckpt.load_state(tmp_path / "c", target)
    with torch.serialization.safe_globals([Custom]):
        ckpt.load_state(tmp_path / "c", target)
    assert target["custom"] == Custom(3) and torch.equal(target["w"], torch.ones(2))


# ------------------------------------------------------------------ what loads as before
def _equal(a: Any, b: Any) -> bool:
    """Bit for bit, types included."""
    if isinstance(a, torch.Tensor):
        return type(a) is type(b) and a.dtype == b.dtype and torch.equal(a, b)
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and _equal(vars(a), vars(b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple, set)) and not isinstance(a, set):
        return type(a) is type(b) and len(a) == len(b) and all(map(_equal, a, b))
    return type(a) is type(b) and a == b


def _as_torch_reads(folder: str) -> list[str]:
    """Keys where the safe path reads ``folder`` otherwise than torch's own reader."""
    ours, theirs = read_metadata(folder), dcp.FileSystemReader(folder).read_metadata()
    ours.storage_meta.load_id = theirs.storage_meta.load_id = None  # per reader
    if ours != theirs:
        return [".metadata"]

    def target() -> dict[str, Any]:
        return {
            k: torch.empty(m.size, dtype=m.properties.dtype)
            if isinstance(m, TensorStorageMetadata)
            else None
            for k, m in ours.state_dict_metadata.items()
        }

    safe, stock = target(), target()
    ckpt.load_state(folder, safe, require_manifest=False)
    dcp.load(stock, storage_reader=dcp.FileSystemReader(folder), planner=DefaultLoadPlanner())
    return [k for k in safe if not _equal(safe[k], stock[k])]


def _kinds(rank: int, world: int, root: str) -> dict[str, list[str]]:
    """Every kind of checkpoint written here, read back both ways."""
    import heavyball
    import pytorch_optimizer

    from flexshard.optim import MatrixOptimizer

    from ..helpers.muon_cases import SHAPES, Mats, full_grads, set_grads

    heavyball.utils.compile_mode = None  # eager: torch.compile on CPU costs minutes

    mesh = init_device_mesh("cpu", (world,))
    kinds = []
    model, opt = _model(mesh)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    extra = {"step": 3, "rng": torch.get_rng_state(), "lr_scheduler": schedule.state_dict()}
    ckpt.save(f"{root}/flexshard", model, opt, extra=extra, entries={"s": schedule.state_dict()})
    saver = AsyncCheckpointer("async")
    saver.save(f"{root}/async", saver.state(model, opt, None), label="async", extra=extra)
    saver.close()
    kinds += ["flexshard", "async"]
    for name, cls, kwargs in (
        ("soap", pytorch_optimizer.SOAP, {"precondition_frequency": 2}),
        ("heavyball_soap", heavyball.SOAP, {"multi_tensor": False}),
        ("psgd", heavyball.PSGDKron, {}),
    ):
        mats = fs.flex_shard(Mats(), mesh=mesh, buckets=[fs.BucketSpec("*", placement=fs.Owned())])
        matrix_opt = MatrixOptimizer(mats.parameters(), cls, lr=0.01, **kwargs)
        for step in range(3):
            set_grads(mats, full_grads(tuple(SHAPES), step))
            matrix_opt.step()
        ckpt.save(f"{root}/{name}", mats, matrix_opt)
        kinds.append(name)
    torch.manual_seed(0)
    theirs = TinyTransformer(TransformerConfig())
    for layer in theirs.layers:
        torch_fully_shard(layer, mesh=mesh)
    torch_fully_shard(theirs, mesh=mesh)
    their_opt = torch.optim.AdamW(theirs.parameters(), lr=1e-2)
    theirs.loss(*make_batches(theirs.cfg, 1, batch=2)[0]).backward()
    their_opt.step()
    state = {
        "model": get_model_state_dict(theirs),
        "optim": get_optimizer_state_dict(theirs, their_opt),
    }
    dcp.save(state, checkpoint_id=f"{root}/fsdp2")
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    dcp.save(dict(zip(("model", "optim"), get_state_dict(theirs, their_opt, options=flat))),
             checkpoint_id=f"{root}/fsdp2_flat")  # fmt: skip
    dcp.save({"model": TinyTransformer(TransformerConfig()).state_dict()},
             checkpoint_id=f"{root}/plain")  # fmt: skip
    kinds += ["fsdp2", "fsdp2_flat", "plain"]
    out = {kind: _as_torch_reads(f"{root}/{kind}") for kind in kinds}
    # torch FSDP2's checkpoint through fs.checkpoint.load: FSDP2's own values, bit for bit
    ours, our_opt = _model(mesh, seed=5)
    for kind in ("fsdp2", "fsdp2_flat"):
        ckpt.load(f"{root}/{kind}", ours, our_opt, require_manifest=False)
        full = StateDictOptions(full_state_dict=True)
        got = {"model": get_model_state_dict(ours, options=full),
               "optim": get_optimizer_state_dict(ours, our_opt, options=full)}  # fmt: skip
        want = {"model": get_model_state_dict(theirs, options=full),
                "optim": get_optimizer_state_dict(theirs, their_opt, options=full)}  # fmt: skip
        out[f"{kind} into flexshard"] = [] if _equal(got, want) else ["values"]
    return out


def test_what_we_and_torch_write_loads_as_torch_reads_it(tmp_path) -> None:
    """flexshard's checkpoints (sync, async, the extras, MatrixOptimizer's state of
    pytorch-optimizer's and heavyball's SOAP and PSGD), torch FSDP2's (nested and
    flattened optimizer state) and a plain model's: the safe path reads every entry
    and the metadata as torch's own reader does, bit for bit; FSDP2's load into a
    flexshard model through fs.checkpoint.load with FSDP2's values."""
    pytest.importorskip("pytorch_optimizer")
    pytest.importorskip("heavyball")
    for rank, out in enumerate(run_distributed(_kinds, 2, os.fspath(tmp_path), timeout=300)):
        assert out and all(v == [] for v in out.values()), (rank, out)
