"""``load`` reads each stored byte once: the chunks' checksums are checked on the bytes
the load reads, not in a pass of their own (``checksums_first`` keeps that pass), with
the same result, and a damaged chunk still raises naming its key with nothing changed."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch

import flexshard as fs


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 17))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 256)).sum().backward()
    optimizer.step()
    return model, optimizer


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    values = [p.detach().clone() for p in model.parameters()]
    return values + [v.clone() for s in optimizer.state.values() for v in s.values()]


def _chunk_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.distcp"))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[torch.Tensor]]:
    folder = tmp_path_factory.mktemp("read_bytes") / "ckpt"
    model, optimizer = _trained(0)
    fs.checkpoint.save(folder, model, optimizer)
    return folder, _state(model, optimizer)


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="Linux's /proc/<pid>/io")
def test_load_reads_each_chunk_once(saved):
    folder, expected = saved
    reads = {}
    for checksums_first in (False, True, False):  # the first load warms the imports up
        model, optimizer = _trained(1)
        before = _rchar()
        fs.checkpoint.load(folder, model, optimizer, checksums_first=checksums_first)
        reads[checksums_first] = _rchar() - before
        loaded = _state(model, optimizer)
        assert all(torch.equal(a, b) for a, b in zip(loaded, expected, strict=True))
    chunks = _chunk_bytes(folder)
    assert chunks < reads[False] < 1.1 * chunks, (reads, chunks)
    assert reads[True] > 2 * chunks, (reads, chunks)


def test_a_corrupted_chunk_read_raises_with_nothing_changed(saved, tmp_path):
    folder, _ = saved
    broken = tmp_path / "broken"
    broken.mkdir()
    for file in folder.iterdir():
        (broken / file.name).write_bytes(file.read_bytes())
    entries = json.loads((broken / "flexshard.json").read_text())["entries"]
    entry = next(e for e in entries if e["key"].startswith("optim.state.1.weight.exp_avg_sq"))
    with open(broken / entry["file"], "r+b") as f:
        f.seek(entry["offset"] + entry["length"] - 8)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    model, optimizer = _trained(1)
    before = _state(model, optimizer)
    message = f"cannot load checkpoint '{broken}': '{entry['key']}' is corrupted: checksum "
    message += f"mismatch in '{entry['file']}'"
    with pytest.raises(ValueError, match=re.escape(message)):
        fs.checkpoint.load(broken, model, optimizer)
    assert all(torch.equal(a, b) for a, b in zip(_state(model, optimizer), before, strict=True))
