"""The planner against published GPU runs (``flexshard-plan --validate``).

Rows are published figures with the trainer config that is their closest equivalent.
Each row is either **calibration** or **held-out**. :func:`fit` sets the few free
efficiency constants (:data:`FITTED`: a bf16 GEMM's share of peak, a Float8 GEMM's,
compile's fused share of the non-GEMM work), each from one calibration row, and
refuses any held-out row; the held-out rows are then predicted with those constants
and are the test. Everything else is documented, not fitted (``hardware.py``,
``techniques.py``, ``recompute.py``, the MoE, ring-attention and pipeline terms of
``steptime.py``); docs/planning_validation.md says which of those effects were added
after the held-out errors had been seen.

Sources: torchtitan ``docs/performance.md`` (tables 1-5: Llama 3.1 on Grand Teton
H100 at 500 W, torch 2024-12-23), FlexShard's DeepSeek-V3 16B on 8 H100 with EP 4
(Meta's FlexShard release figures, quoted in docs/planning_validation.md). Published
memory is torchtitan's peak *reserved* memory (``reserved_bytes.all.peak``, what its
log's ``memory`` prints); the plan's is its peak of live tensors plus what the caching
allocator holds beyond them, simulated (``reserve.py``)."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flexshard.trainer.config import load_config

from .buckets import fsdp2_equivalent
from .hardware import BUILTIN, Hardware
from .host_costs import NO_HOST_COSTS
from .report import backend_plan, build_stages, planning_config
from .steptime import StepTime, step_time
from .techniques import TORCHTITAN_OP_AC, TRAINER, Techniques

ROOT = Path(__file__).resolve().parents[2]
GiB = 2**30
CALIBRATION, HELD_OUT = "calibration", "held-out"
TARGET = 0.10  # the goal: within 10% of every published row

TT = "torchtitan docs/performance.md"
FS = "FlexShard (ANCHORS.md)"
TOKENS = "tokens_per_s_per_device"
EXPOSED_AG = "exposed_all_gather_ms"
EXPOSED_COMM = "exposed_comm_ms"
METRIC_LABEL = {
    TOKENS: "tokens/s/GPU",
    EXPOSED_AG: "exposed AG ms",
    EXPOSED_COMM: "exposed comm ms",
}

LLAMA_VOCAB = ("--model.vocab_size", "128256")
SELECTIVE_OP = ("--activation_checkpoint.mode", "selective")
FULL_AC = ("--activation_checkpoint.mode", "full")
COMPILE = ("--compile.enable", "true")
# torchtitan runs loss parallel wherever tp > 1 (``disable_loss_parallel`` false by default)
TITAN_AC = Techniques(op_ac_recomputed_mm=TORCHTITAN_OP_AC, loss_parallel=True)
# one host's runs went through run_llama_train.sh, which sets the caching allocator's
# expandable_segments:True at 9dec370; its multi-node launcher (multinode_trainer.slurm)
# does not, so the runs on several hosts are taken without it
ONE_HOST = 8
# Float8 as torchtitan's docs/float8.md and its 405B config run it: FSDP Float8 all-gather
TITAN_FP8 = dataclasses.replace(TITAN_AC, float8=True, float8_all_gather=True)
TITAN_FP8_ASYNC = dataclasses.replace(TITAN_FP8, async_tp=True)


@dataclass(frozen=True)
class Run:
    """One planned run: a config, its overrides, the world, what it runs beyond the
    config, on which backend and hardware profile."""

    config: str
    world: int
    overrides: tuple[str, ...]
    backend: str = "fsdp2"
    techniques: Techniques = TRAINER
    hardware: str = "h100-gt500"


@dataclass(frozen=True)
class Row:
    key: str
    source: str
    layout: str
    run: Run
    metric: str
    published: float
    role: str
    memory_gib: float | None = None  # published peak memory (reserved), where given


def _titan_8b(world: int, extra: tuple[str, ...], techniques: Techniques) -> Run:
    overrides = (*LLAMA_VOCAB, "--training.batch_size", "2", *SELECTIVE_OP, *extra)
    return Run("configs/llama3_8b.toml", world, overrides, techniques=techniques)


def _titan_cp(seq: int, cp: int) -> Run:
    overrides = (
        *LLAMA_VOCAB,
        *FULL_AC,
        *COMPILE,
        "--training.batch_size",
        "1",
        "--training.seq_len",
        str(seq),
        "--parallelism.cp",
        str(cp),
        # torchtitan's CP is torch's context_parallel: ring attention
        "--parallelism.cp_method",
        "ring",
    )
    return Run("configs/llama3_8b.toml", 8, overrides, techniques=TITAN_FP8)


_70B = ("--training.batch_size", "16", *FULL_AC, *COMPILE)
# 405B: 128 blocks (pp 8 must divide them; Llama has 126); local batch 32 in 8
# microbatches: torchtitan's default then (pipeline_parallel_microbatches unset = pp)
_405B = (
    "--model.n_layers",
    "128",
    "--parallelism.pp",
    "8",
    "--parallelism.pp_microbatches",
    "8",
    "--training.batch_size",
    "32",
    *FULL_AC,
    *COMPILE,
)
# the published run's batch is not given: torchtitan's deepseek_v3_16b.toml (local batch 8,
# seq 4096, full AC, no compile), assumed; GQA here where DeepSeek has MLA
_MOE = (
    "--model.vocab_size",
    "102400",
    "--parallelism.ep",
    "4",
    "--training.batch_size",
    "8",
    *FULL_AC,
)


def _moe(backend: str) -> Run:
    return Run("configs/moe.toml", 8, _MOE, backend=backend, hardware="h100")


ROWS: tuple[Row, ...] = (
    # calibration: Llama 3.1 8B on 8 GPUs, one row per fitted constant
    Row("tt1-eager", f"{TT} table 1", "FSDP 8, selective op AC",
        _titan_8b(8, (), TITAN_AC), TOKENS, 5762, CALIBRATION, 82.4),
    Row("tt1-compile", f"{TT} table 1", "FSDP 8, selective op AC, compile",
        _titan_8b(8, COMPILE, TITAN_AC), TOKENS, 6667, CALIBRATION, 77.0),
    Row("tt1-compile-fp8", f"{TT} table 1", "FSDP 8, selective op AC, compile, Float8",
        _titan_8b(8, COMPILE, TITAN_FP8), TOKENS, 8532, CALIBRATION, 76.8),
    # held out: other scales, models, layouts and libraries
    Row("tt3-eager", f"{TT} table 3", "FSDP 128, selective op AC",
        _titan_8b(128, (), TITAN_AC), TOKENS, 5605, HELD_OUT, 67.0),
    Row("tt3-compile", f"{TT} table 3", "FSDP 128, selective op AC, compile",
        _titan_8b(128, COMPILE, TITAN_AC), TOKENS, 6514, HELD_OUT, 62.0),
    Row("tt3-compile-fp8", f"{TT} table 3", "FSDP 128, selective op AC, compile, Float8",
        _titan_8b(128, COMPILE, TITAN_FP8), TOKENS, 8380, HELD_OUT, 61.8),
    Row("tt2-cp1", f"{TT} table 2", "FSDP 8, CP 1, seq 32k, full AC, compile, Float8",
        _titan_cp(32768, 1), TOKENS, 3890, CALIBRATION, 83.9),
    Row("tt2-cp2", f"{TT} table 2", "FSDP 4, CP 2, seq 64k, full AC, compile, Float8",
        _titan_cp(65536, 2), TOKENS, 2540, HELD_OUT, 84.2),
    Row("tt2-cp4", f"{TT} table 2", "FSDP 2, CP 4, seq 128k, full AC, compile, Float8",
        _titan_cp(131072, 4), TOKENS, 1071, HELD_OUT, 84.0),
    Row("tt2-cp8", f"{TT} table 2", "FSDP 1, CP 8, seq 256k, full AC, compile, Float8",
        _titan_cp(262144, 8), TOKENS, 548, HELD_OUT, 84.5),
    Row("tt4-2d", f"{TT} table 4", "70B: FSDP 32, TP 8, full AC, compile, Float8",
        Run("configs/llama3_70b.toml", 256, _70B, techniques=TITAN_FP8),
        TOKENS, 829, HELD_OUT, 71.9),
    Row("tt4-async-tp", f"{TT} table 4", "70B: FSDP 32, TP 8, + async TP",
        Run("configs/llama3_70b.toml", 256, _70B, techniques=TITAN_FP8_ASYNC),
        TOKENS, 876, CALIBRATION, 67.6),
    Row("tt5-1f1b", f"{TT} table 5", "405B: FSDP 8, TP 8, PP 8 1F1B, async TP",
        Run("configs/llama3_405b.toml", 512, _405B, techniques=TITAN_FP8_ASYNC),
        TOKENS, 100, HELD_OUT, 82.5),
    Row("tt5-interleaved", f"{TT} table 5", "405B: FSDP 8, TP 8, PP 8 interleaved (2 per rank)",
        Run("configs/llama3_405b.toml", 512,
            (*_405B, "--parallelism.pp_schedule", "interleaved_1f1b",
             "--parallelism.pp_virtual_stages", "2"),
            techniques=TITAN_FP8_ASYNC),
        TOKENS, 128, HELD_OUT, 72.7),
    Row("fs-fsdp2", FS, "16B MoE: FSDP 8, EP 4 (FSDP2)", _moe("fsdp2"), TOKENS, 9281, HELD_OUT),
    Row("fs-flexshard", FS, "16B MoE: FSDP 8, EP 4 (FlexShard)", _moe("flexshard"),
        TOKENS, 9456, HELD_OUT),
    Row("fs-fsdp2-ag", FS, "16B MoE (FSDP2)", _moe("fsdp2"), EXPOSED_AG, 110.1, HELD_OUT),
    Row("fs-flexshard-ag", FS, "16B MoE (FlexShard)", _moe("flexshard"),
        EXPOSED_AG, 30.3, HELD_OUT),
    Row("fs-fsdp2-comm", FS, "16B MoE (FSDP2)", _moe("fsdp2"), EXPOSED_COMM, 340.5, HELD_OUT),
    Row("fs-flexshard-comm", FS, "16B MoE (FlexShard)", _moe("flexshard"),
        EXPOSED_COMM, 265.0, HELD_OUT),
)  # fmt: skip

#: each fitted constant, the calibration row that sets it, and its range
FITTED: tuple[tuple[str, str, tuple[float, float]], ...] = (
    ("gemm_efficiency", "tt1-eager", (0.05, 1.0)),
    ("fused_share", "tt1-compile", (0.0, 1.0)),
    ("fp8_gemm_efficiency", "tt1-compile-fp8", (0.05, 1.0)),
    ("attention_tflops", "tt2-cp1", (50.0, 989.0)),
    ("async_tp_overlap", "tt4-async-tp", (0.0, 1.0)),
)


TOLERANCE = 1e-6  # relative gap at which a constant meets its row
MAX_STEPS = 60  # secant steps per constant and sweep, at most
SWEEPS = 20  # at most; the fit stops once no constant moves by 1e-4


@dataclass
class Built:
    """A run's layout, built once: the config, mesh, every pipeline stage's buckets
    (for its backend) and the busiest stage's peak memory."""

    cfg: Any
    dims: Any
    stages: list[list]
    memory_bytes: int  # the busiest stage's peak reserved by the caching allocator
    live_bytes: int  # that stage's peak of live tensors


def _layout_overrides(overrides: tuple[str, ...]) -> tuple[str, ...]:
    """``overrides`` less ``--compile.enable``: compiling changes no layout or memory."""
    out: list[str] = []
    words = iter(overrides)
    for word in words:
        if word == COMPILE[0]:
            next(words)
        else:
            out.append(word)
    return tuple(out)


@functools.cache
def _layout(
    config: str,
    world: int,
    overrides: tuple[str, ...],
    backend: str,
    hardware: str,
    memory_techniques: Techniques,
) -> tuple[Any, list[list], int, int]:
    """(mesh, every stage's buckets, the busiest stage's peak reserved and live memory),
    built once per layout: the runs that differ in compile or techniques alone share it."""
    cfg = planning_config(load_config(str(ROOT / config), list(overrides)))
    dims, stages = build_stages(cfg, world, None)
    plan = backend_plan(cfg, dims, stages, BUILTIN[hardware], backend, memory_techniques)
    if backend == "fsdp2":
        stages = [fsdp2_equivalent(s) for s in stages]
    return dims, stages, plan["memory"]["reserved"], plan["memory"]["total"]


def _memory_techniques(run: Run) -> Techniques:
    """What of ``run.techniques`` and its launch changes memory: the checkpoint policy,
    loss parallel, the allocator's expandable segments (one host's runs)."""
    t = run.techniques
    return Techniques(
        op_ac_recomputed_mm=t.op_ac_recomputed_mm,
        loss_parallel=t.loss_parallel,
        expandable_segments=run.world <= ONE_HOST,
    )


@functools.cache
def build(run: Run) -> Built:
    cfg = planning_config(load_config(str(ROOT / run.config), list(run.overrides)))
    layout = _layout_overrides(run.overrides)
    dims, stages, reserved, live = _layout(
        run.config, run.world, layout, run.backend, run.hardware, _memory_techniques(run)
    )
    return Built(cfg, dims, stages, reserved, live)


def profile(run: Run, constants: dict[str, float]) -> Hardware:
    """The run's hardware profile with the fitted constants."""
    return dataclasses.replace(BUILTIN[run.hardware], **constants)


def step(run: Run, constants: dict[str, float]) -> StepTime:
    """The slowest stage's step (a pipeline moves at its pace), as the plan counts it."""
    b = build(run)
    hw = profile(run, constants)
    steps = [
        step_time(b.cfg, b.dims, s, hw, None, run.backend, NO_HOST_COSTS, run.techniques)
        for s in b.stages
    ]
    return max(steps, key=lambda s: s.step_s)


def predict(row: Row, constants: dict[str, float]) -> float:
    """The row's metric as the model predicts it with ``constants``."""
    s = step(row.run, constants)
    if row.metric == TOKENS:
        return s.tokens_per_s_per_device
    if row.metric == EXPOSED_AG:
        return s.exposed_all_gather_s * 1e3
    if row.metric == EXPOSED_COMM:
        return (s.exposed_dp_s + s.exposed_other_s) * 1e3
    raise ValueError(f"row {row.key!r}: unknown metric {row.metric!r}")


def _solve(row: Row, name: str, bounds: tuple[float, float], fixed: dict[str, float]) -> float:
    """The value of ``name`` in ``bounds`` whose prediction meets the row's figure (the
    nearest bound when none does): predictions are monotonic in each constant, so a
    bracketing secant (Illinois) converges in a few predictions."""
    lo, hi = bounds

    def gap(x: float) -> float:
        return predict(row, {**fixed, name: x}) / row.published - 1

    g_lo, g_hi = gap(lo), gap(hi)
    if g_lo * g_hi > 0:
        return lo if abs(g_lo) < abs(g_hi) else hi
    side = 0
    x = lo
    for _ in range(MAX_STEPS):
        x = (lo * g_hi - hi * g_lo) / (g_hi - g_lo)
        g = gap(x)
        if abs(g) < TOLERANCE:
            break
        if g * g_hi > 0:
            hi, g_hi = x, g
            if side == -1:
                g_lo /= 2
            side = -1
        else:
            lo, g_lo = x, g
            if side == 1:
                g_hi /= 2
            side = 1
    return x


def fit(rows: tuple[Row, ...] | list[Row]) -> dict[str, float]:
    """The constants of :data:`FITTED`, each from its calibration row among ``rows``
    (one constant at a time, others held, swept until they settle: every row depends on
    several); a held-out row among them is refused (it is the test, never an input)."""
    held = [r.key for r in rows if r.role != CALIBRATION]
    if held:
        raise ValueError(f"fit: rows {held} are held out; calibration reads calibration rows only")
    by_key = {r.key: r for r in rows}
    missing = [key for _, key, _ in FITTED if key not in by_key]
    if missing:
        raise ValueError(f"fit: calibration rows {missing} are missing")
    constants: dict[str, float] = {}
    for _ in range(SWEEPS):
        before = dict(constants)
        for name, key, bounds in FITTED:
            constants[name] = _solve(by_key[key], name, bounds, constants)
        if before and all(abs(constants[k] / before[k] - 1) < 1e-4 for k in before if before[k]):
            break
    return constants


def validate(rows: tuple[Row, ...] = ROWS) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """The fitted constants and, per row, predicted vs published."""
    constants = fit([r for r in rows if r.role == CALIBRATION])
    table = []
    for row in rows:
        value = predict(row, constants)
        built = build(row.run)
        memory, live = built.memory_bytes / GiB, built.live_bytes / GiB
        table.append(
            {
                "key": row.key,
                "source": row.source,
                "layout": row.layout,
                "metric": row.metric,
                "predicted": value,
                "published": row.published,
                "error": value / row.published - 1,
                "memory_predicted_gib": memory if row.memory_gib is not None else None,
                "memory_live_gib": live if row.memory_gib is not None else None,
                "memory_published_gib": row.memory_gib,
                "memory_error": memory / row.memory_gib - 1 if row.memory_gib else None,
                "role": row.role,
            }
        )
    return constants, table


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:+.1f}%"


def _num(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:,.1f}"


COLUMNS = (
    "row",
    "source",
    "layout",
    "metric",
    "predicted",
    "published",
    "error",
    "memory GiB live / reserved / published",
    "memory error (reserved)",
    "set",
)


def render(constants: dict[str, float], table: list[dict[str, Any]]) -> str:
    """The markdown table ``--validate`` prints, with the fit and a summary per set."""
    lines = [
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    for r in table:
        memory = (
            f"{_num(r['memory_live_gib'])} / {_num(r['memory_predicted_gib'])} / "
            f"{_num(r['memory_published_gib'])}"
        )
        cells = (
            r["key"],
            r["source"],
            r["layout"],
            METRIC_LABEL[r["metric"]],
            _num(r["predicted"]),
            _num(r["published"]),
            _pct(r["error"]),
            memory,
            _pct(r["memory_error"]),
            r["role"],
        )
        lines.append("| " + " | ".join(cells) + " |")
    fitted = ", ".join(f"{k} = {v:.3f}" for k, v in constants.items())
    lines += ["", f"fitted on the calibration rows only: {fitted}"]
    for role in (CALIBRATION, HELD_OUT):
        errors = [abs(r["error"]) for r in table if r["role"] == role]
        within = sum(e <= TARGET for e in errors)
        lines.append(
            f"{role}: {within} of {len(errors)} rows within {TARGET:.0%}, "
            f"largest |error| {max(errors) * 100:.1f}%"
        )
    memory = [abs(r["memory_error"]) for r in table if r["memory_error"] is not None]
    lines.append(
        f"memory (reserved, no constant fitted): {sum(e <= TARGET for e in memory)} of "
        f"{len(memory)} rows within {TARGET:.0%}, largest |error| {max(memory) * 100:.1f}%"
    )
    return "\n".join(lines) + "\n"
