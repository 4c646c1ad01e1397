"""Bad checkpoints and bad checkpoint input: a clear ValueError naming the key, raised
on every rank, with no parameter or optimizer state changed; a save killed half-way
leaves no directory that looks complete.

The distributed cases run in one spawn of W = 2 ranks; each records the error and
whether the model and optimizer kept their values, and the parent checks them one by one.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import flexshard as fs
from flexshard import checkpoint as ckpt
from flexshard.testing import TinyTransformer, TransformerConfig, make_batches, run_distributed


def _mixed(fqn: str, param: torch.Tensor) -> fs.Placement:
    if param.ndim < 2:
        return fs.FlatShard()
    return fs.Owned() if "up" in fqn else fs.Shard(0)


def _model(mesh, cfg: TransformerConfig = TransformerConfig(), seed: int = 0):
    torch.manual_seed(seed)
    model = fs.flex_shard(
        TinyTransformer(cfg), mesh=mesh, buckets=[fs.BucketSpec("*", placement=_mixed)]
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens, targets = make_batches(cfg, 1, batch=2)[0]
    model.loss(tokens, targets).backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _snapshot(model, opt) -> list[torch.Tensor]:
    values = [p.detach().clone() for p in model.parameters()]
    for state in opt.state.values():
        values += [v.clone() for v in state.values()]
    return values


def _unchanged(before: list[torch.Tensor], model, opt) -> bool:
    after = _snapshot(model, opt)
    return len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))


def _damage(root: str, case: str) -> str:
    """Break a copy of the good checkpoint (rank 0 only); returns the key it breaks."""
    with open(os.path.join(root, "flexshard.json")) as f:
        entries = json.load(f)["entries"]
    if case == "truncated":  # the last chunk of rank 1's file loses its second half
        entry = max((e for e in entries if e["file"] == "__1_0.distcp"), key=lambda e: e["offset"])
        with open(os.path.join(root, entry["file"]), "r+b") as f:
            f.truncate(entry["offset"] + entry["length"] // 2)
        return entry["key"]
    if case == "corrupted":
        entry = next(e for e in entries if e["key"].startswith("model.layers.0.up.weight"))
        with open(os.path.join(root, entry["file"]), "r+b") as f:
            f.seek(entry["offset"] + entry["length"] - 8)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x40]))
        return entry["key"]
    if case == "metadata corrupted":
        with open(os.path.join(root, ".metadata"), "r+b") as f:
            f.seek(10)
            f.write(b"\x00\x01\x02")
    elif case == "manifest unreadable":
        with open(os.path.join(root, "flexshard.json"), "w") as f:
            f.write("{not json")
    elif case == "incomplete":
        os.remove(os.path.join(root, "flexshard.json"))
    return ""


DAMAGES = {
    "truncated": r"'(model|optim)\.[\w.]+ at offsets \[.*\]' is missing or truncated in '__1_0",
    "corrupted": r"'model\.layers\.0\.up\.weight( at offsets \[.*\])?' is corrupted: checksum",
    "metadata corrupted": r"'\.metadata' is corrupted",
    "manifest unreadable": r"flexshard\.json is unreadable",
    "incomplete": r"is not a complete flexshard checkpoint: it has no flexshard\.json",
}
MISMATCHES = {
    "path missing": r"no checkpoint at '.*nowhere': the directory does not exist",
    "missing key": r"key 'model\.layers\.2\.attn_norm\.bias' is missing from the checkpoint",
    "other shapes": r"key 'model\.layers\.0\.up\.weight' has shape \(29, 18\) in the "
    r"checkpoint, the model expects \(31, 18\)",
    "other model": r"key 'model\.layers\.1\.attn_norm\.bias' in the checkpoint is not in the model",
    "no optimizer state": r"the checkpoint holds no optimizer state",
    "optimizer of other parameters": r"optimizer state does not match the optimizer",
    "wrong-shape load_state_dict": r"state dict entry 'layers\.0\.up\.weight' has shape "
    r"\(3, 3\), bucket 'bucket0' expects \(29, 18\)",
    "save onto a file": r"cannot save a checkpoint to '.*a_file': a file is there",
    "foreign optimizer parameter": r"optimizer param group 0 holds a parameter of shape "
    r"\(2, 2\) that is not in the model",
}
CASES = {**DAMAGES, **MISMATCHES}


def _cases(rank: int, world: int, root: str) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    model, opt = _model(mesh)
    good = f"{root}/good"
    ckpt.save(good, model, opt)
    ckpt.save(f"{root}/no_optim", model)
    torch.distributed.barrier()
    results = {}

    def attempt(case: str, target, target_opt, call) -> None:
        before = _snapshot(target, target_opt)
        try:
            call()
            results[case] = (None, "no error", _unchanged(before, target, target_opt), "")
        except Exception as err:  # recorded for the parent to check
            outcome = (type(err).__name__, str(err), _unchanged(before, target, target_opt))
            results[case] = (*outcome, "")

    damaged = [""]
    for case in DAMAGES:
        broken = f"{root}/{case.replace(' ', '_')}"
        if rank == 0:
            shutil.copytree(good, broken)
            damaged[0] = _damage(broken, case)
        torch.distributed.barrier()
        fresh, fresh_opt = _model(mesh, seed=1)
        attempt(case, fresh, fresh_opt, functools.partial(ckpt.load, broken, fresh, fresh_opt))
        results[case] = (*results[case][:3], damaged[0])

    fresh, fresh_opt = _model(mesh, seed=1)
    attempt(
        "path missing", fresh, fresh_opt, lambda: ckpt.load(f"{root}/nowhere", fresh, fresh_opt)
    )
    bigger, bigger_opt = _model(mesh, TransformerConfig(layers=3), seed=1)
    attempt("missing key", bigger, bigger_opt, lambda: ckpt.load(good, bigger, bigger_opt))
    wider, wider_opt = _model(mesh, TransformerConfig(hidden=31), seed=1)
    attempt("other shapes", wider, wider_opt, lambda: ckpt.load(good, wider, wider_opt))
    smaller, smaller_opt = _model(mesh, TransformerConfig(layers=1), seed=1)
    attempt("other model", smaller, smaller_opt, lambda: ckpt.load(good, smaller, smaller_opt))
    attempt(
        "no optimizer state",
        fresh,
        fresh_opt,
        lambda: ckpt.load(f"{root}/no_optim", fresh, fresh_opt),
    )
    # an optimizer over a subset of the parameters: its groups do not match the saved ones
    subset = torch.optim.AdamW(list(fresh.parameters())[:3], lr=1e-2)
    attempt(
        "optimizer of other parameters", fresh, fresh_opt, lambda: ckpt.load(good, fresh, subset)
    )
    state = fresh.state_dict()
    state["layers.0.up.weight"] = torch.zeros(3, 3)
    attempt("wrong-shape load_state_dict", fresh, fresh_opt, lambda: fresh.load_state_dict(state))
    if rank == 0:
        open(f"{root}/a_file", "w").close()
    torch.distributed.barrier()
    attempt("save onto a file", fresh, fresh_opt, lambda: ckpt.save(f"{root}/a_file", fresh))
    foreign = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2, 2))])
    attempt(
        "foreign optimizer parameter", fresh, fresh_opt, lambda: ckpt.save(good, fresh, foreign)
    )
    # the model is untouched after every failure: its parameters are still DTensor views
    assert isinstance(fresh.state_dict()["layers.0.qkv.weight"], DTensor)
    return results


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> list[dict]:
    return run_distributed(_cases, 2, os.fspath(tmp_path_factory.mktemp("bad")), timeout=200)


@pytest.mark.parametrize("case", list(CASES))
def test_bad_checkpoint_raises_naming_the_key(outcomes, case):
    damaged = outcomes[0][case][3]  # the key rank 0 broke, where it broke one
    for rank, results in enumerate(outcomes):
        kind, message, unchanged, _ = results[case]
        assert kind == "ValueError", f"rank {rank}: {kind}: {message}"
        assert re.search(CASES[case], message), f"rank {rank}: {message}"
        assert f"'{damaged}'" in message if damaged else True
        assert unchanged, f"rank {rank}: {case} changed the model or optimizer"


KILLED_SAVE = textwrap.dedent(
    """
    import os, sys, torch
    import flexshard.checkpoint.io as io
    from flexshard.testing import TinyTransformer
    path, point = sys.argv[1], sys.argv[2]

    def die(*args, **kwargs):
        os._exit(9)

    if point == "writing data":
        io.FileSystemWriter.write_data = die
    elif point == "before the manifest":
        io._finish = die
    else:
        io._move_into_place = die
    torch.manual_seed(1)
    io.save(path, TinyTransformer())
    """
)


@pytest.mark.parametrize("point", ["writing data", "before the manifest", "before the rename"])
def test_save_killed_half_way_leaves_nothing_that_looks_complete(tmp_path, point):
    path = os.fspath(tmp_path / "ckpt")
    torch.manual_seed(0)
    ckpt.save(path, TinyTransformer())  # a complete earlier checkpoint at the same path
    run = subprocess.run([sys.executable, "-c", KILLED_SAVE, path, point], capture_output=True)
    assert run.returncode == 9, run.stderr.decode()[-2000:]
    # the earlier checkpoint is still there, whole; the killed one is not complete
    model = TinyTransformer()
    ckpt.load(path, model)
    torch.manual_seed(0)
    expected = TinyTransformer().state_dict()
    assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())
    if point != "before the rename":  # there the new one is complete, not yet in place
        with pytest.raises(ValueError, match="is not a complete flexshard checkpoint"):
            ckpt.load(path + ".partial", TinyTransformer())
    # a new save over the leftovers succeeds
    torch.manual_seed(1)
    ckpt.save(path, TinyTransformer())
    torch.manual_seed(1)
    expected = TinyTransformer().state_dict()
    ckpt.load(path, model)
    assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())
    assert not os.path.exists(path + ".partial")


def test_a_damaged_safetensors_folder_is_named_before_loading(tmp_path):
    """What a download cut short, a Git LFS pointer or a stale index look like: one
    ValueError naming the file and what is wrong, from the headers alone."""
    from safetensors.torch import save_file

    from flexshard.checkpoint.hf_safetensors import check_safetensors_folder

    name = "model-00001-of-00002.safetensors"
    save_file({"w": torch.ones(4, 4), "b": torch.zeros(4)}, tmp_path / name)
    check_safetensors_folder(tmp_path)
    whole = (tmp_path / name).read_bytes()
    cases = [
        (whole[:-1], f"truncated: header says {len(whole)} bytes, file has {len(whole) - 1}"),
        (whole + b"\0", f"longer than its header says: header says {len(whole)} bytes"),
        (whole[:5], "not a safetensors file (5 bytes, no header)"),
        (b"version https://git-lfs.github.com/spec/v1\n", "a Git LFS pointer, not the weights"),
        (whole[:8] + b"{not json" + whole[17:], "not a safetensors file (its header is not one)"),
    ]
    for data, message in cases:
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ValueError, match=re.escape(f"'{tmp_path / name}': {message}")):
            check_safetensors_folder(tmp_path)
    (tmp_path / name).write_bytes(whole)
    index = {"weight_map": {"w": name, "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="names 'model-00002-of-00002.safetensors', which"):
        check_safetensors_folder(tmp_path)
