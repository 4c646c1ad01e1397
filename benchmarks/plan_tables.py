"""The markdown of ``benchmarks/plan_validation.py``'s results: the CPU rows
(predicted vs measured, per-term breakdown), the archived low-load runs and the
published H100 figures, with the readings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

BLOCKING = {True: "are waited for at launch (CPU: nothing overlaps)", False: "run on streams"}


def write_markdown(result: dict[str, Any], path: Path) -> None:
    hw = result["cpu_profile"]
    host = hw.get("host_costs", {})
    lines = [
        "# flexshard-plan validation: predicted vs measured (CPU) and vs published (H100)",
        "",
        f"Command: `.venv/bin/{result.get('command', 'python -m benchmarks.plan_validation')}`  ",
        f"Date: {result['date']}; torch {result['torch']}; {result['machine']}",
        "",
        "## CPU, gloo: predicted vs measured step time",
        "",
        f"Profile from micro-benchmarks only (`cpu_gloo_profile.json` holds the median "
        "over the launches): "
        f"one-thread fp32, timed on the unsharded models' own ops at their shapes "
        f"(`flexshard/plan/calibration.py`): GEMMs {hw['peak_tflops'] * 1e3:.1f} GFLOP/s, "
        f"causal attention {hw.get('attention_tflops', 0.0) * 1e3:.1f} GFLOP/s; non-GEMM ops "
        f"{hw['op_overhead_us']:.2f} us each + bytes at {hw['elementwise_gbps']:.1f} GB/s; "
        f"buffer copies {hw['copy_gbps']:.1f} GB/s; gloo all-gather {hw['intra_gbps']:.3f} "
        f"GB/s, reduce-scatter {hw['reduce_scatter_gbps']:.3f} GB/s, "
        f"{hw['intra_latency_us'] / 1e3:.2f} ms per ring step + "
        f"{hw['collective_overhead_us'] / 1e3:.2f} ms per call; collectives overlap "
        f"compute by {hw['overlap']:.0%} in the micro-benchmark, but "
        f"{BLOCKING[bool(hw.get('blocking_collectives'))]}"
        f"; DTensor {host.get('dtensor_op_overhead_us', 0.0):.1f} us "
        f"per op; contention x{host.get('contention', 1.0):.2f} on what is timed op by op; "
        f"eager autograd {host.get('eager_op_us', 0.0):.1f} us per op; the runtimes' own "
        f"cost per parameter gathered / reduced: flexshard "
        f"{host.get('flexshard_gather_param_us', 0.0):.0f} / "
        f"{host.get('flexshard_reduce_param_us', 0.0):.0f} us, FSDP2 "
        f"{host.get('fsdp2_gather_param_us', 0.0):.0f} / "
        f"{host.get('fsdp2_reduce_param_us', 0.0):.0f} us (`flexshard/plan/calibration.py`). "
        f"Each of {result['reps']} repetitions runs W = 2, 3, 4 (reversed every "
        "other one), each W one launch that calibrates its profile with all W ranks at "
        "once (`benchmarks/plan_launch.py`), measures the rows, calibrates again; each "
        "row is predicted on its own launch's profile. Measured: "
        f"the trainer, median step of {result['steps'] - result['warmup']} steps after "
        f"{result['warmup']} warm-up, slowest rank; the table gives the median over the "
        "repetitions (range in brackets) and the median of the per-repetition gaps. "
        "trainer = bench_trainer's model (dim 256, 4 layers, seq 128, batch 4); dp = "
        "bench_dp's shapes (dim 256, ffn 1024, vocab 1024, seq 64, batch 4). fp32, AdamW.",
        "",
        "| W | model | backend | placement | measured ms | predicted ms | gap | "
        "model: GEMM / non-GEMM / copies + runtime / optimizer / exposed comm ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["cpu"]:
        low, high = min(r["measured_reps_ms"]), max(r["measured_reps_ms"])
        parts = (
            r["gemm_ms"],
            r["compute_ms"] - r["gemm_ms"],
            r["copy_ms"],
            r["optimizer_ms"],
            r["exposed_dp_ms"],
        )
        lines.append(
            f"| {r['world']} | {r['model']} | {r['backend']} | {r['placement']} | "
            f"{r['measured_ms']:.0f} [{low:.0f}-{high:.0f}] | {r['step_ms']:.0f} | "
            f"{r['gap']:+.0%} | {' / '.join(f'{v:.0f}' for v in parts)} |"
        )
    within = sum(abs(r["gap"]) <= 0.25 for r in result["cpu"])
    lines += [
        "",
        f"Within 25%: {within} of {len(result['cpu'])} rows. `uptime` at the start of each "
        "repetition and at the end: "
        + "; ".join(f"`{u.split('load average:')[-1].strip()}`" for u in result["uptime"])
        + " (other jobs shared the 2 cores).",
        "",
        "The same model against earlier runs made at low load (`trainer_bench.json` at "
        "e51fa4a: the same trainer model; `dp_bench.json` at a52b2f6, load 2.7-5.1: "
        "bench_dp's TinyTransformer, planned as the trainer's model of the same shapes):",
        "",
        "| W | model | backend | placement | measured ms (archived) | predicted ms | gap |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["archived"]:
        lines.append(
            f"| {r['world']} | {r['model']} | {r['backend']} | {r['placement']} | "
            f"{r['measured_ms']:.1f} | {r['predicted_ms']:.1f} | {r['gap']:+.0%} |"
        )
    within = sum(abs(r["gap"]) <= 0.25 for r in result["archived"])
    lines += [
        "",
        f"Within 25%: {within} of {len(result['archived'])} rows.",
        "",
        "## H100: predicted vs published",
        "",
        "| run | published | metric | backend | predicted | gap | set (--validate) or note |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["published"]:
        lines.append(
            f"| {r['name']} | {r['published']:,.4g} | {r['metric_label']} | {r['backend']} | "
            f"{r['predicted']:,.4g} | {r['gap']:+.0%} | {r['caveat']} |"
        )
    lines += ["", "## Readings", "", *result["readings"]]
    path.write_text("\n".join(lines) + "\n")
