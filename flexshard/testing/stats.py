"""Ratios that a noisy shared machine cannot turn into a claim: the median over
repetitions of a per-repetition ratio, its spread, and a verdict against a target that
says "met" only when the whole spread is on the right side of it.

Every side-by-side benchmark uses this file: it runs both sides in each repetition,
alternating their order (``alternating``), forms one ratio per repetition
(``paired_ratios``), summarises them (``spread``) and judges them (``verdict``).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

T = TypeVar("T")

MET, NOT_MET, NOT_ESTABLISHED, NO_TARGET = "met", "not met", "not established", "–"


@dataclass(frozen=True)
class Spread:
    """A sample summarised: median, interquartile range, min–max and its size."""

    median: float
    q1: float
    q3: float
    lo: float
    hi: float
    n: int

    def bounds(self, basis: str = "iqr") -> tuple[float, float]:
        """The interval a verdict is judged on: ``"iqr"`` (q1, q3) or ``"range"`` (min, max)."""
        if basis == "iqr":
            return self.q1, self.q3
        if basis == "range":
            return self.lo, self.hi
        raise ValueError(f"spread basis must be 'iqr' or 'range', got {basis!r}")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def spread(values: Sequence[float]) -> Spread:
    """Median, quartiles (linear interpolation between order statistics, i.e. the
    "inclusive" method: with 5 values q1 and q3 are the 2nd and 4th smallest) and min–max."""
    data = sorted(float(v) for v in values)
    if not data:
        raise ValueError("spread of an empty sample: no repetition was measured")
    if any(v != v for v in data):
        raise ValueError(f"spread of a sample with NaN: {list(values)}")
    median = statistics.median(data)
    if len(data) == 1:
        q1 = q3 = median
    else:
        q1, _, q3 = statistics.quantiles(data, n=4, method="inclusive")
    return Spread(median, q1, q3, data[0], data[-1], len(data))


def paired_ratios(numerator: Sequence[float], denominator: Sequence[float]) -> list[float]:
    """One ratio per repetition: side A's value over side B's from the same repetition."""
    if len(numerator) != len(denominator):
        raise ValueError(
            f"paired ratios need one value per repetition on both sides, got "
            f"{len(numerator)} and {len(denominator)}"
        )
    if any(d <= 0 for d in denominator):
        raise ValueError(f"ratio against a non-positive reference value: {list(denominator)}")
    return [a / b for a, b in zip(numerator, denominator)]


def verdict(
    s: Spread, target: float | None, *, lower_is_better: bool = True, basis: str = "iqr"
) -> str:
    """Verdict "met" if the whole spread is within the target, "not met" if it is wholly
    outside, otherwise "not established"; "–" without a target."""
    if target is None:
        return NO_TARGET
    lo, hi = s.bounds(basis)
    if not lower_is_better:
        lo, hi, target = -hi, -lo, -target  # mirror: "ratio >= target" as "-ratio <= -target"
    if hi <= target:
        return MET
    if lo > target:
        return NOT_MET
    return NOT_ESTABLISHED


def alternating(items: Sequence[T], rep: int) -> tuple[T, ...]:
    """The order of the sides in repetition ``rep``: as given on even repetitions,
    reversed on odd ones, so that each pair of sides runs A..B, B..A, A..B, ..."""
    return tuple(items) if rep % 2 == 0 else tuple(reversed(items))


def centred(items: Sequence[T], reference: T) -> tuple[T, ...]:
    """``items`` with ``reference`` moved to the middle: run in this order (and reversed,
    see ``alternating``), every side is at most about half the list away from the
    reference it is compared with, so slow drift in machine load weighs less."""
    others = [x for x in items if x != reference]
    if len(others) == len(items):
        raise ValueError(f"reference {reference!r} is not among {list(items)}")
    middle = len(others) // 2
    return (*others[:middle], reference, *others[middle:])


def summary(
    ratios: Sequence[float], target: float | None = None, *, lower_is_better: bool = True
) -> dict[str, Any]:
    """What a results file stores for one ratio: the per-repetition values, their
    spread and the verdict (judged on the interquartile range)."""
    s = spread(ratios)
    return {
        "per_rep": [float(r) for r in ratios],
        **s.as_dict(),
        "target": target,
        "lower_is_better": lower_is_better,
        "verdict": verdict(s, target, lower_is_better=lower_is_better),
    }


def cell(entry: dict[str, Any], digits: int = 2) -> str:
    """A table cell: ``0.93 [0.90–0.97]`` (median [IQR])."""
    f = f"{{:.{digits}f}}"
    return f"{f.format(entry['median'])} [{f.format(entry['q1'])}–{f.format(entry['q3'])}]"


def range_cell(entry: dict[str, Any], digits: int = 2) -> str:
    """A table cell with the full min–max: ``0.88–1.01``."""
    f = f"{{:.{digits}f}}"
    return f"{f.format(entry['lo'])}–{f.format(entry['hi'])}"


def verdict_cell(entry: dict[str, Any]) -> str:
    """``met (≤ 0.95)``, ``not established (≤ 0.95)``, or ``–`` without a target."""
    if entry["target"] is None:
        return NO_TARGET
    sign = "≤" if entry["lower_is_better"] else "≥"
    return f"{entry['verdict']} ({sign} {entry['target']:.2f})"


RULE = (
    "Ratios: one per repetition (both sides measured in the same repetition, their order "
    "alternating from one repetition to the next), then the median over repetitions "
    "[interquartile range, inclusive quartiles]; min–max in the JSON and the results "
    "files. Verdict: **met** only if the whole interquartile range is within the "
    "target, **not met** if it is wholly outside, otherwise **not established**."
)
