"""The trainer's ``placement = "muon"`` against FSDP2's layout with a redistributing
DistMuon (``placement = "shard0"``), measured on 4 gloo ranks (a Llama-style model with
fewer heads than ranks), and the plan of the same config: the muon side's optimizer
step moves nothing, its gathered parameters and bucket bytes are no larger, and the
plan predicts both (``flexshard.testing.muon_layouts``; ``benchmarks/muon_layouts.py``
prints every case)."""

from __future__ import annotations

from flexshard.testing.muon_layouts import compare


def test_muon_placement_measured_against_shard0_and_the_plan() -> None:
    muon, shard0 = compare("llama", 4, steps=3)
    # every Muon matrix owned whole: the plan splits none, DistMuon sends nothing
    assert muon["planned"]["optimizer_bytes"] == 0, muon["planned"]
    assert max(muon["optimizer_bytes_per_rank"]) == 0 and muon["optimizer_collectives"] == 0
    # the baseline redistributes every matrix, as its plan says
    assert shard0["optimizer_collectives"] > 0
    assert shard0["optimizer_bytes_per_rank"] == [shard0["planned"]["optimizer_bytes"]] * 4
    assert muon["gathered_params_peak"] <= 1.05 * shard0["gathered_params_peak"]
    # bytes averaged over the ranks (a ragged bucket's ranks send their own extents)
    assert muon["bucket_bytes_mean"] <= shard0["bucket_bytes_mean"]
    for row in (muon, shard0):
        plan = row["planned"]
        assert abs(row["gap_gathered_params"]) <= 0.10, row
        assert abs(row["gap_total"]) <= 0.10, row
        assert row["bytes_per_step_mean"] == plan["bytes_per_step"], row
    assert muon["max_loss_gap"] < 1e-5
