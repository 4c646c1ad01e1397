"""The benchmarks' ratio statistics (flexshard/testing/stats.py): pure math, no timing."""

from __future__ import annotations

import math
import random

import pytest

from flexshard.testing.stats import (
    MET,
    NO_TARGET,
    NOT_ESTABLISHED,
    NOT_MET,
    alternating,
    cell,
    centred,
    paired_ratios,
    spread,
    summary,
    verdict,
    verdict_cell,
)


def test_spread_of_five_uses_order_statistics() -> None:
    s = spread([1.3, 0.9, 1.1, 0.7, 1.0])
    assert (s.median, s.q1, s.q3, s.lo, s.hi, s.n) == (1.0, 0.9, 1.1, 0.7, 1.3, 5)


def test_spread_interpolates_between_order_statistics() -> None:
    # inclusive quartiles of 1..4: positions 0.75 and 2.25 of the sorted sample
    s = spread([4.0, 1.0, 3.0, 2.0])
    assert (s.median, s.q1, s.q3) == (2.5, 1.75, 3.25)


def _quantile(data: list[float], p: float) -> float:
    """Linear interpolation between order statistics at position p (n - 1)."""
    ordered = sorted(data)
    pos = p * (len(ordered) - 1)
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (pos - low) * (ordered[high] - ordered[low])


def test_spread_matches_a_brute_force_quantile() -> None:
    rng = random.Random(7)
    for n in (2, 3, 5, 6, 9, 17):
        data = [rng.uniform(0.5, 1.5) for _ in range(n)]
        s = spread(data)
        assert s.q1 == pytest.approx(_quantile(data, 0.25), abs=1e-12)
        assert s.median == pytest.approx(_quantile(data, 0.5), abs=1e-12)
        assert s.q3 == pytest.approx(_quantile(data, 0.75), abs=1e-12)
        assert s.lo <= s.q1 <= s.median <= s.q3 <= s.hi


def test_spread_of_one_value_is_that_value() -> None:
    s = spread([0.93])
    assert (s.median, s.q1, s.q3, s.lo, s.hi) == (0.93, 0.93, 0.93, 0.93, 0.93)


def test_spread_refuses_empty_and_nan() -> None:
    with pytest.raises(ValueError, match="empty"):
        spread([])
    with pytest.raises(ValueError, match="NaN"):
        spread([1.0, float("nan")])


def test_paired_ratios_pair_repetitions() -> None:
    assert paired_ratios([2.0, 3.0, 9.0], [4.0, 3.0, 3.0]) == [0.5, 1.0, 3.0]
    with pytest.raises(ValueError, match="one value per repetition"):
        paired_ratios([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="non-positive"):
        paired_ratios([1.0], [0.0])


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([0.80, 0.85, 0.90, 0.92, 0.99], MET),  # IQR 0.85–0.92 within 0.95, max is not
        ([0.80, 0.90, 0.94, 0.96, 0.99], NOT_ESTABLISHED),  # IQR 0.90–0.96 crosses 0.95
        ([0.90, 0.96, 0.97, 1.00, 1.10], NOT_MET),  # IQR 0.96–1.00 wholly above
        ([0.95, 0.95, 0.95, 0.95, 0.95], MET),  # on the target counts as within
    ],
)
def test_verdict_on_the_interquartile_range(values: list[float], expected: str) -> None:
    assert verdict(spread(values), 0.95) == expected


def test_verdict_on_the_full_range_is_stricter() -> None:
    s = spread([0.80, 0.85, 0.90, 0.92, 0.99])
    assert verdict(s, 0.95, basis="range") == NOT_ESTABLISHED
    assert verdict(spread([0.96, 0.97, 1.2]), 0.95, basis="range") == NOT_MET
    with pytest.raises(ValueError, match="basis"):
        verdict(s, 0.95, basis="stdev")


def test_verdict_higher_is_better_mirrors() -> None:
    assert verdict(spread([1.1, 1.2, 1.3]), 1.0, lower_is_better=False) == MET
    assert verdict(spread([0.9, 1.0, 1.1]), 1.0, lower_is_better=False) == NOT_ESTABLISHED
    assert verdict(spread([0.7, 0.8, 0.9]), 1.0, lower_is_better=False) == NOT_MET
    assert verdict(spread([1.0, 1.0]), 1.0, lower_is_better=False) == MET


def test_verdict_without_target() -> None:
    assert verdict(spread([3.0]), None) == NO_TARGET


def test_alternating_flips_every_repetition() -> None:
    orders = [alternating(("fsdp2", "a", "b"), rep) for rep in range(4)]
    assert orders == [("fsdp2", "a", "b"), ("b", "a", "fsdp2")] * 2
    # every pair of sides runs in both orders over two repetitions
    for x, y in (("fsdp2", "a"), ("a", "b"), ("fsdp2", "b")):
        firsts = {o.index(x) < o.index(y) for o in orders[:2]}
        assert firsts == {True, False}


def test_summary_and_cells() -> None:
    entry = summary([1.0, 0.9, 0.8, 0.85, 0.95], 0.95)
    assert entry["per_rep"] == [1.0, 0.9, 0.8, 0.85, 0.95]
    assert entry["verdict"] == MET  # IQR 0.85–0.95
    assert cell(entry) == "0.90 [0.85–0.95]"
    assert verdict_cell(entry) == "met (≤ 0.95)"
    up = summary([0.9, 1.1], 1.0, lower_is_better=False)
    assert verdict_cell(up) == "not established (≥ 1.00)"
    assert verdict_cell(summary([1.0])) == NO_TARGET


def test_centred_puts_the_reference_in_the_middle() -> None:
    assert centred(("fsdp2", "a", "b", "c", "d"), "fsdp2") == ("a", "b", "fsdp2", "c", "d")
    assert centred(("fsdp2", "a"), "fsdp2") == ("fsdp2", "a")
    assert centred(("a", "b", "ref"), "ref") == ("a", "ref", "b")
    with pytest.raises(ValueError, match="not among"):
        centred(("a", "b"), "ref")
