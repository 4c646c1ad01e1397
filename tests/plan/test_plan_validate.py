"""``flexshard-plan --validate``: the planner against published GPU runs, fitted on the
calibration rows only and tested on the held-out rows (``flexshard/plan/published.py``)."""

from __future__ import annotations

import contextlib
import dataclasses
import io

import pytest

from flexshard.plan import published
from flexshard.plan.calibration import BLOCK, ROOT
from flexshard.plan.cli import main
from flexshard.plan.hardware import BUILTIN, H100
from flexshard.plan.published import CALIBRATION, COLUMNS, HELD_OUT, ROWS, fit, predict
from flexshard.plan.recompute import recompute_parts
from flexshard.plan.report import make_plan
from flexshard.plan.techniques import Techniques, float8_scale_bytes
from flexshard.trainer.config import load_config

# cheap held-out rows: another scale with Float8, and context parallelism
CHOSEN = ("tt3-compile-fp8", "tt2-cp2")


def _validate(*argv: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["--validate", *argv]) == 0
    return out.getvalue()


def _table(text: str) -> list[list[str]]:
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in line.strip("|").split(" | ")] for line in lines]


def _calibration() -> list[published.Row]:
    return [r for r in ROWS if r.role == CALIBRATION]


def test_validate_prints_every_row_and_the_held_out_errors_are_the_models() -> None:
    text = _validate("--rows", ",".join(CHOSEN))
    header, *body = _table(text)
    assert tuple(header) == COLUMNS
    by_key = {r.key: r for r in ROWS}
    printed = {cells[0]: cells for cells in body}
    assert set(printed) == {*CHOSEN, *(r.key for r in _calibration())}
    for key, cells in printed.items():
        row = by_key[key]
        assert cells[1] == row.source and cells[2] == row.layout
        assert cells[9] == row.role
        assert cells[5] == published._num(row.published)
        if row.memory_gib is not None:  # live, reserved (live + the allocator's), published
            live, reserved, memory = (float(x) for x in cells[7].split(" / "))
            assert live < reserved and memory == row.memory_gib, key
    # recomputed apart: the fit on the calibration rows, then each held-out row's model
    # (the slow test below checks the model is make_plan's)
    constants = fit(_calibration())
    for key in CHOSEN:
        row = by_key[key]
        assert row.role == HELD_OUT
        value = predict(row, constants)
        assert printed[key][6] == published._pct(value / row.published - 1)
        assert printed[key][4] == published._num(value)
    # the summary: the fitted constants and each set's count within 10%
    assert "fitted on the calibration rows only: gemm_efficiency = " in text
    assert (
        f"held-out: {sum(abs(float(printed[k][6][:-1])) <= 10 for k in CHOSEN)} of 2 rows" in text
    )


def test_calibration_refuses_a_held_out_row() -> None:
    held = next(r for r in ROWS if r.role == HELD_OUT)
    with pytest.raises(ValueError, match=f"{held.key}.*held out"):
        fit([*_calibration(), held])
    with pytest.raises(ValueError, match="missing"):
        fit(_calibration()[1:])


def test_the_fit_does_not_move_when_held_out_figures_do() -> None:
    rows = tuple(r for r in ROWS if r.role == CALIBRATION or r.key == "tt3-eager")
    constants, table = published.validate(rows)
    moved = tuple(
        dataclasses.replace(r, published=r.published * 3) if r.role == HELD_OUT else r for r in rows
    )
    again, table_again = published.validate(moved)
    assert again == constants
    before = {t["key"]: t["predicted"] for t in table}
    assert before == {t["key"]: t["predicted"] for t in table_again}
    # and the calibration rows are met: each constant is fitted on its own row
    errors = {t["key"]: t["error"] for t in table if t["role"] == CALIBRATION}
    assert max(abs(e) for e in errors.values()) < 0.02, errors


def test_the_gt500_profile_carries_the_fit() -> None:
    """``--hardware h100-gt500`` plans with the constants the calibration rows give now."""
    constants = fit(_calibration())
    profile = BUILTIN["h100-gt500"]
    for name, value in constants.items():
        assert getattr(profile, name) == pytest.approx(value, rel=5e-3), name


def test_float8_scaling_bytes_and_rates() -> None:
    # eager: amax + cast of the input and weight in forward (5 B per element), their
    # transposes (2 B) and the gradient's amax + cast + transpose (7 B) in backward
    assert float8_scale_bytes(10, 3, 4, compiled=False) == (5 * (40 + 12), 2 * (40 + 12) + 7 * 30)
    assert float8_scale_bytes(10, 3, 4, compiled=True) == (3 * (40 + 12), 1 * (40 + 12) + 4 * 30)
    assert H100.fp8_flops_per_s() == pytest.approx(2 * H100.gemm_flops_per_s(), rel=1e-3)
    slow = dataclasses.replace(H100, sustained_clock=0.5)
    assert slow.gemm_flops_per_s() == pytest.approx(H100.gemm_flops_per_s() / 2)
    with pytest.raises(ValueError, match="fp8_tflops"):
        dataclasses.replace(H100, fp8_tflops=0.0).fp8_flops_per_s()
    with pytest.raises(ValueError, match="op_ac_recomputed_mm"):
        Techniques(op_ac_recomputed_mm=1.5)


def test_recompute_policies() -> None:
    full = load_config("configs/debug.toml", ["--activation_checkpoint.mode", "full"])
    op = load_config("configs/debug.toml", ["--activation_checkpoint.mode", "selective"])
    assert recompute_parts(full) == (1.0, 1.0)
    assert recompute_parts(op) == (0.0, 1.0)  # the trainer's policy keeps every matmul
    assert recompute_parts(op, 0.5) == (0.5, 1.0)  # torchtitan's: every second one again


def test_techniques_move_the_step_the_documented_way() -> None:
    """Float8 speeds the GEMMs up, compile's fusion cuts the non-GEMM time, a recompute
    adds time, async TP hides TP collectives: each term, one at a time."""
    hw = dataclasses.replace(H100, fused_share=0.5, async_tp_overlap=1.0)
    base = ["--model.n_layers", "2", "--parallelism.tp", "2"]

    def step(extra: list[str], techniques: Techniques = Techniques()) -> dict:
        cfg = load_config("configs/llama3_8b.toml", [*base, *extra])
        plan = make_plan(cfg, 4, hw, 0, ("fsdp2",), techniques=techniques)
        return plan["backends"]["fsdp2"]["step"]

    plain = step([])
    assert step([], Techniques(float8=True))["gemm_s"] < plain["gemm_s"] * 0.7
    compiled = step(["--compile.enable", "true"])
    non_gemm = plain["compute_s"] - plain["gemm_s"]
    # the blocks' non-GEMM work halves; the LM head and loss are not compiled
    assert 0.5 * non_gemm < compiled["compute_s"] - compiled["gemm_s"] < 0.75 * non_gemm
    full = step(["--activation_checkpoint.mode", "full"])
    assert full["gemm_s"] > plain["gemm_s"] * 1.25
    assert full["exposed_other_s"] == pytest.approx(plain["exposed_other_s"] * 1.5)
    assert step([], Techniques(async_tp=True))["exposed_other_s"] == 0.0


@pytest.mark.slow
def test_validate_all_rows_and_the_docs_table_is_current() -> None:
    text = _validate()
    _, *body = _table(text)
    assert [cells[0] for cells in body] == [r.key for r in ROWS]
    # the program's own path: make_plan on the fitted profile gives the table's figure
    constants = fit(_calibration())
    for key in ("tt3-compile-fp8", "fs-fsdp2-ag"):
        row = next(r for r in ROWS if r.key == key)
        run = row.run
        cfg = load_config(str(ROOT / run.config), list(run.overrides))
        hw = published.profile(run, constants)
        plan = make_plan(cfg, run.world, hw, None, (run.backend,), techniques=run.techniques)
        step = plan["backends"][run.backend]["step"]
        value = (
            step["tokens_per_s_per_device"]
            if row.metric == published.TOKENS
            else step["exposed_all_gather_s"] * 1e3
        )
        assert value == pytest.approx(predict(row, constants), rel=1e-12), key
    page = (ROOT / "docs/planning_validation.md").read_text()
    (block,) = [m for m in BLOCK.finditer(page) if "--validate" in m.group("command")]
    assert block.group("body") == text, "run: .venv/bin/python -m benchmarks.plan_docs --write"
