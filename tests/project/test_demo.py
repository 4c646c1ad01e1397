"""``flexshard-demo``: its placements are the ones its command line offers, and a short
run on two ranks trains and reports what each bucket moved."""

from __future__ import annotations

from flexshard.demo.cli import PLACEMENT_NAMES, main
from flexshard.demo.train import PLACEMENTS


def test_the_command_line_offers_every_placement() -> None:
    assert sorted(PLACEMENTS) == list(PLACEMENT_NAMES)


def test_two_ranks_train_and_report(capfd) -> None:
    main(["--nproc", "2", "--steps", "3"])
    out = capfd.readouterr().out  # rank 0 prints from its own process
    assert "step   3/3" in out
    assert "outer" in out and "total" in out
    first, final = out.split("loss: first ")[1].split(" (")[0].split(" -> final ")
    assert float(final) < float(first)
