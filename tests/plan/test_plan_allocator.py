"""The caching allocator's simulation (flexshard/plan/allocator.py) against the rules of
torch's c10/cuda/CUDACachingAllocator.cpp, and the step's allocation sequence
(flexshard/plan/reserve.py) against the plan's own peak of live tensors."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from flexshard.plan.allocator import CachingAllocator, round_size, segment_size
from flexshard.plan.hardware import BUILTIN
from flexshard.plan.report import backend_plan, build_stages, planning_config
from flexshard.plan.techniques import Techniques
from flexshard.trainer.config import load_config

MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[2]


def test_sizes_round_to_512_bytes_and_segments_by_pool():
    assert [round_size(n) for n in (1, 512, 513, 1000)] == [512, 512, 1024, 1024]
    assert segment_size(1 * MiB) == 2 * MiB  # the small pool's 2 MiB buffer
    assert segment_size(1 * MiB + 512) == 20 * MiB  # 1 to 10 MiB: a 20 MiB segment
    assert segment_size(10 * MiB) == 10 * MiB  # from 10 MiB: rounded up to 2 MiB
    assert segment_size(11 * MiB) == 12 * MiB


def test_small_requests_share_a_2_mib_segment():
    a = CachingAllocator()
    a.malloc("a", 1000)
    a.malloc("b", 300)
    assert (a.allocated, a.reserved) == (1024 + 512, 2 * MiB)


def test_a_large_pool_segment_is_split_only_above_1_mib_left():
    a = CachingAllocator()
    a.malloc("a", 5 * MiB)  # a 20 MiB segment, split: 15 MiB left free
    a.malloc("b", 14 * MiB + 512)  # takes the 15 MiB leftover whole (512 KiB over is no split)
    assert a.reserved == 20 * MiB
    assert a.allocated == 20 * MiB  # the unsplit block counts whole
    a.malloc("c", 5 * MiB)  # nothing free: a new 20 MiB segment
    assert a.reserved == 40 * MiB


def test_best_fit_and_merging_of_freed_neighbours():
    a = CachingAllocator()
    for key in ("a", "b", "c"):
        a.malloc(key, 12 * MiB)  # three 12 MiB segments
    a.malloc("d", 6 * MiB)  # a 20 MiB segment: 14 MiB left
    a.free("a")
    a.malloc("e", 11 * MiB)  # best fit: the 12 MiB block, not the 14 MiB leftover
    assert a.reserved == 3 * 12 * MiB + 20 * MiB
    a.free("d")  # merges with its 14 MiB leftover: 20 MiB free
    a.malloc("f", 19 * MiB)
    assert a.reserved == 3 * 12 * MiB + 20 * MiB


def test_a_block_serves_only_its_own_stream():
    a = CachingAllocator()
    a.malloc("a", 12 * MiB, "all-gather")
    a.free("a")
    a.malloc("b", 12 * MiB)  # the cached 12 MiB is the all-gather stream's
    assert (a.allocated, a.reserved, a.peak_reserved) == (12 * MiB, 24 * MiB, 24 * MiB)


def test_short_of_capacity_the_free_segments_are_released_and_retried():
    a = CachingAllocator(capacity=40 * MiB)
    a.malloc("a", 12 * MiB)
    a.malloc("b", 12 * MiB)
    a.free("a")
    a.malloc("c", 20 * MiB)  # 44 MiB would pass 40: a's segment is released first
    assert (a.retries, a.over_capacity, a.reserved) == (1, 0, 32 * MiB)
    a.malloc("d", 20 * MiB)  # nothing left to release: over capacity (an OOM on a device)
    assert a.over_capacity == 1


def test_expandable_segments_grow_by_20_mib_pages():
    a = CachingAllocator(expandable=True)
    a.malloc("a", 5 * MiB)
    a.malloc("b", 5 * MiB)
    assert a.reserved == 20 * MiB  # one page holds both
    a.free("a")
    a.malloc("c", 30 * MiB)  # the 5 MiB hole is too small: the 10 MiB tail grows a page
    assert a.reserved == 40 * MiB
    a.malloc("d", 4 * MiB)  # the hole left at the front
    assert a.reserved == 40 * MiB
    a.malloc("e", 300)  # the small pool: its own segment, 2 MiB pages
    assert a.reserved == 42 * MiB


def test_expandable_segments_unmap_their_free_end_short_of_capacity():
    a = CachingAllocator(expandable=True, capacity=60 * MiB)
    a.malloc("a", 40 * MiB, "all-gather")
    a.free("a")  # 40 MiB mapped, free, on the all-gather stream
    a.malloc("b", 40 * MiB)  # 80 MiB would pass 60: the free pages are unmapped first
    assert (a.retries, a.reserved, a.over_capacity) == (1, 40 * MiB, 0)


def test_a_freed_key_and_a_key_in_use_are_refused():
    a = CachingAllocator()
    a.malloc("a", 10)
    with pytest.raises(ValueError, match="'a' is already live"):
        a.malloc("a", 10)
    a.free("a")
    with pytest.raises(KeyError):
        a.free("a")


@pytest.mark.parametrize("expandable", [False, True])
def test_the_step_sequence_peaks_where_the_plan_does(expandable):
    """The allocation sequence is the plan's tensors one by one: its peak is the plan's
    live peak (within 5%: the storages of two blocks stand for all, and it also holds
    the reduce-scatter outputs in flight), and the allocator reserves at least that."""
    cfg = planning_config(load_config(str(ROOT / "configs/llama3_8b.toml"), [
        "--model.n_layers", "4", "--training.batch_size", "1", "--training.seq_len", "2048",
    ]))  # fmt: skip
    dims, stages = build_stages(cfg, 4, None)
    techniques = dataclasses.replace(Techniques(), expandable_segments=expandable)
    memory = backend_plan(cfg, dims, stages, BUILTIN["h100"], "fsdp2", techniques)["memory"]
    assert memory["allocator_simulated_peak"] == pytest.approx(memory["total"], rel=0.05)
    assert memory["allocator_reserve"] >= 0
    assert memory["reserved"] == memory["total"] + memory["allocator_reserve"]


def test_the_cli_reports_the_reserved_peak(tmp_path):
    from flexshard.plan.cli import main

    out = {}
    for flag in ((), ("--expandable-segments",)):
        path = tmp_path / f"plan{len(flag)}.json"
        assert main(["configs/debug.toml", "--world", "8", *flag, "--json", str(path)]) == 0
        out[flag] = json.loads(path.read_text())["backends"]["fsdp2"]["memory"]
    for memory in out.values():
        assert memory["reserved"] == memory["total"] + memory["allocator_reserve"]
        assert memory["allocator_reserve"] > 0  # small tensors take whole 2 / 20 MiB segments
