"""``load(..., reads="striped")``: each stored chunk read from storage once, by one of
the ranks that need it, and sent to the others; the loaded model and optimizer equal
DCP's own load bit for bit at W = 4 (2 replicas x 2 shards) and from a W = 2 save at
W = 3 and W = 4, a damaged chunk still raises naming its key, and a rank that dies
mid-load makes the others raise naming it instead of hanging.

One spawn of 4 ranks covers the loads (W = 2 and W = 3 on sub-groups); the death needs
a spawn of its own."""

from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

import flexshard as fs
from flexshard.checkpoint import striped_read
from flexshard.testing import TinyTransformer, TransformerConfig, make_batches, run_distributed
from tests.runtime.test_faults import run_tolerant

TIMEOUT = datetime.timedelta(seconds=60)  # generous: the machine is shared


def _matrices(fqn: str, param: torch.Tensor) -> fs.Placement:
    return fs.Owned() if "up" in fqn else fs.Shard(0)


BUCKETS = [
    fs.BucketSpec("*norm*", placement=fs.Replicate(), name="norms"),  # every rank needs all
    fs.BucketSpec(
        ["embed.*", "*qkv*", "*proj*", "*up*", "*down*", "head.*"], placement=_matrices, name="rest"
    ),
]


def _trained(mesh, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    cfg = TransformerConfig()
    torch.manual_seed(seed)
    model = fs.flex_shard(TinyTransformer(cfg), mesh=mesh, buckets=BUCKETS)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens, targets = make_batches(cfg, 1, batch=2, seed=seed)[0]
    model.loss(tokens, targets).backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def _values(model, optimizer) -> list[torch.Tensor]:
    """What this rank holds: local shards of the parameters and the optimizer state."""
    out = [p.to_local().clone() for p in model.parameters()]
    for state in optimizer.state.values():
        out += [
            v.to_local().clone() if hasattr(v, "to_local") else v.clone() for v in state.values()
        ]
    return out


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


class _Counted:
    """Bytes the striped reader took from storage in this process (chunks only)."""

    bytes = 0

    @classmethod
    def install(cls) -> None:
        read = striped_read.StripedReader._read

        def counted(reader, index, files):
            data = read(reader, index, files)
            cls.bytes += len(data)
            return data

        striped_read.StripedReader._read = counted


def _load(root: str, mesh, reads: str) -> dict:
    model, optimizer = _trained(mesh, seed=99)  # other values than the saved ones
    counted, rchar = _Counted.bytes, _rchar()
    fs.checkpoint.load(root, model, optimizer, reads=reads)
    return {
        "values": _values(model, optimizer),
        "stripe": _Counted.bytes - counted,
        "rchar": _rchar() - rchar,
    }


def _save_two(rank: int, world: int, folder: str) -> None:
    model, optimizer = _trained(dist.group.WORLD, seed=0)
    fs.checkpoint.save(os.path.join(folder, "w2"), model, optimizer)


def _loads(mesh, root: str) -> dict:
    out = {}
    for reads in ("dcp", "striped", "dcp", "striped"):  # the first of each warms up
        out[reads] = _load(root, mesh, reads)
    return out


def _corrupt(root: str) -> str:
    """Flip a bit of a replicated tensor's chunk (every rank needs it); its key."""
    entries = json.load(open(os.path.join(root, "flexshard.json")))["entries"]
    entry = next(e for e in entries if e["key"].startswith("optim.state.norm.weight.exp_avg"))
    with open(os.path.join(root, entry["file"]), "r+b") as f:
        f.seek(entry["offset"] + entry["length"] - 8)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    return entry["key"]


def _at_four(rank: int, world: int, folder: str) -> dict:
    hsdp = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("replicate", "shard"))
    _Counted.install()
    four, broken = os.path.join(folder, "w4"), os.path.join(folder, "broken")
    model, optimizer = _trained(hsdp, seed=1)
    fs.checkpoint.save(four, model, optimizer)
    out = {"hsdp": _loads(hsdp, four), "2 -> 4": _loads(dist.group.WORLD, folder + "/w2")}
    if rank == 0:
        shutil.copytree(four, broken)
        out["broken key"] = _corrupt(broken)
    dist.barrier()
    model, optimizer = _trained(hsdp, seed=99)
    before = _values(model, optimizer)
    try:
        fs.checkpoint.load(broken, model, optimizer, reads="striped")
    except ValueError as err:
        out["broken"] = str(err)
    after = _values(model, optimizer)
    out["broken unchanged"] = all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    return out


def _at_three(rank: int, world: int, folder: str) -> dict:
    _Counted.install()
    return {"2 -> 3": _loads(dist.group.WORLD, os.path.join(folder, "w2"))}


@pytest.fixture(scope="module")
def loads(tmp_path_factory):
    folder = tmp_path_factory.mktemp("striped")
    run_distributed(_save_two, 2, os.fspath(folder), timeout=200)
    four = run_distributed(_at_four, 4, os.fspath(folder), timeout=300)
    three = run_distributed(_at_three, 3, os.fspath(folder), timeout=200)
    return folder, [{**a, **b} for a, b in zip(four, [*three, {}], strict=True)]


def _file_bytes(root) -> int:
    return sum(f.stat().st_size for f in root.glob("*.distcp"))


@pytest.mark.parametrize("case, ranks", [("hsdp", 4), ("2 -> 4", 4), ("2 -> 3", 3)])
def test_striped_load_is_dcps_bit_for_bit(loads, case, ranks):
    _, results = loads
    for rank in range(ranks):
        dcp, striped = results[rank][case]["dcp"], results[rank][case]["striped"]
        assert len(dcp["values"]) == len(striped["values"]) > 0
        for a, b in zip(dcp["values"], striped["values"], strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize(
    "case, ranks, saved", [("hsdp", 4, "w4"), ("2 -> 4", 4, "w2"), ("2 -> 3", 3, "w2")]
)
def test_each_stored_chunk_is_read_once(loads, case, ranks, saved):
    """A load of the whole model and optimizer needs every stored chunk: the ranks'
    stripes add up to the chunk files exactly, where DCP's plan reads the shared chunks
    once per rank that needs them (rchar; the striped load's rchar also counts the bytes
    gloo receives from its sockets, so it says nothing of storage here)."""
    folder, results = loads
    root = folder / saved
    chunks = _file_bytes(root)
    stripes = [results[r][case]["striped"]["stripe"] for r in range(ranks)]
    assert sum(stripes) == chunks, (stripes, chunks)
    assert max(stripes) < 0.6 * chunks, stripes  # shared out, not all on one rank
    dcp = sum(results[r][case]["dcp"]["rchar"] for r in range(ranks))
    assert dcp > 1.5 * chunks, (dcp, chunks)


def test_a_corrupted_chunk_raises_naming_the_key(loads):
    folder, results = loads
    key = results[0]["broken key"]
    for rank in range(4):
        assert f"'{key}' is corrupted: checksum mismatch" in results[rank]["broken"]
        assert results[rank]["broken unchanged"]


def _dies_mid_load(rank: int, world: int, root: str) -> dict:
    if rank == 2:  # dies after reading its stripe, before the first exchange
        striped_read.StripedReader._exchange = lambda *args: os._exit(3)
    model, optimizer = _trained(dist.group.WORLD, seed=99)
    before, started = _values(model, optimizer), time.monotonic()
    try:
        fs.checkpoint.load(root, model, optimizer, reads="striped", timeout=TIMEOUT)
    except Exception as err:
        after = _values(model, optimizer)
        return {
            "type": type(err).__name__,
            "error": str(err),
            "seconds": time.monotonic() - started,
            "unchanged": all(torch.equal(a, b) for a, b in zip(before, after, strict=True)),
        }
    return {"type": None}


def test_a_rank_dying_mid_load_is_named(loads):
    folder, _ = loads
    results = run_tolerant(_dies_mid_load, 3, os.fspath(folder / "w2"), timeout=120)
    assert results[2] is None  # it died without a word
    for rank in (0, 1):
        got = results[rank]
        assert got["type"] == "CollectiveError", got
        assert got["unchanged"] and got["seconds"] < TIMEOUT.total_seconds() + 30, got
        assert re.search(
            r"load of checkpoint .* in the striped read's batch 0: rank\(s\) \[2\] never reached",
            got["error"],
        ), got


def test_the_schedule_reads_each_chunk_once_and_bounds_the_staging():
    """Pure planning, no processes: every needed chunk has one reader among its needers,
    reaches every other needer, each rank's staging per batch stays within the budget
    (a chunk larger than it travels alone), and the reads add up to the chunks needed."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    world, budget = 3, 100
    lengths = {MetadataIndex(f"t{i}", [i]): 10 + 7 * i for i in range(12)}
    lengths[MetadataIndex("big", [0])] = 250
    keys = list(lengths)
    needs = [keys[r::2] + keys[:3] for r in range(world)]  # overlapping, and shared by all
    plans = striped_read.stripe_schedule(needs, lengths, lambda i: (i.fqn, i.offset), budget)
    assert len({len(p) for p in plans}) == 1  # every rank runs the same batches
    got: dict = {r: set() for r in range(world)}
    readers: dict = {}
    for number in range(len(plans[0])):
        parts = [p[number] for p in plans]
        assert len({p.exchange for p in parts}) == 1
        staged = [0] * world
        for rank, part in enumerate(parts):
            for index, dests in part.reads:
                assert index not in readers
                readers[index] = rank
                got[rank].add(index)
                staged[rank] += lengths[index] * len(dests)
                for dest in dests:
                    assert (index, rank) in parts[dest].receives
                    got[dest].add(index)
            staged[rank] += sum(lengths[i] for i, _ in part.receives)
        chunks = {i for p in parts for i, _ in p.reads}
        assert max(staged) <= budget or len(chunks) == 1, (number, staged)
    for rank in range(world):
        assert got[rank] == set(needs[rank])
    assert all(index in needs[rank] for index, rank in readers.items())  # a needer reads it
    read = [sum(lengths[i] for i, r in readers.items() if r == rank) for rank in range(world)]
    assert sum(read) == sum(lengths[i] for i in set().union(*map(set, needs)))


def test_the_choice_is_checked_where_it_is_made(tmp_path):
    from flexshard.trainer.config import ConfigError, config_from_dict

    assert config_from_dict({"checkpoint": {"reads": "striped"}}).checkpoint.reads == "striped"
    with pytest.raises(ConfigError, match="checkpoint.reads = 'bogus': must be one of"):
        config_from_dict({"checkpoint": {"reads": "bogus"}})
    model = torch.nn.Linear(3, 2)
    fs.checkpoint.save(tmp_path / "ckpt", model)
    with pytest.raises(ValueError, match=re.escape("reads = 'bogus': must be one of")):
        fs.checkpoint.load(tmp_path / "ckpt", model, reads="bogus")
