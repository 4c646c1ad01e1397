"""The plan as text: per-rank memory and step time side by side per backend, then the
busiest buckets' bytes."""

from __future__ import annotations

from typing import Any

GiB = 2**30


def _gib(x: float) -> str:
    return f"{x / GiB:,.2f}"


ROWS = (
    ("parameters (sharded)", lambda p: _gib(p["memory"]["params"])),
    ("gradients (sharded)", lambda p: _gib(p["memory"]["grads"])),
    ("optimizer state", lambda p: _gib(p["memory"]["optimizer"])),
    ("gathered buffers in flight (worst moment)", lambda p: _gib(p["memory"]["gathered_peak"])),
    ("activations (worst moment)", lambda p: _gib(p["memory"]["activations"])),
    ("total per rank (GiB): peak of one moment", lambda p: _gib(p["memory"]["total"])),
    ("  the moment", lambda p: p["memory"]["peak_moment"]),
    (
        "  gathered / activations / gradients then",
        lambda p: " / ".join(
            _gib(p["memory"]["at_peak"][k]) for k in ("gathered", "activations", "grads")
        ),
    ),
    ("  each part at its own peak, added", lambda p: _gib(p["memory"]["sum_of_part_peaks"])),
    (
        "async checkpoint staging (host GiB)",
        lambda p: _gib(p["memory"]["staging_host"]) if p["memory"]["staging_host"] else "-",
    ),
    ("bytes sent per step (GiB)", lambda p: _gib(p["bytes_per_step"])),
    ("max padding of a bucket", lambda p: f"{max(b['padding'] for b in p['buckets']):.1%}"),
    (
        "storage max / mean over ranks",
        lambda p: " ".join(f"{s['max_over_mean']:.3f}" for s in p["storage_balance"]),
    ),
    (
        "Muon busiest rank (TFLOP)",
        lambda p: f"{p['muon']['busiest_tflop']:.2f}" if p["muon"] else "-",
    ),
    ("Muon max / mean", lambda p: f"{p['muon']['imbalance']:.3f}" if p["muon"] else "-"),
    (
        "Muon all-to-all per step (GiB)",
        lambda p: _gib(p["muon"]["all_to_all_bytes"]) if p["muon"] else "-",
    ),
    ("step time (ms)", lambda p: f"{p['step']['step_s'] * 1e3:,.1f}"),
    ("compute (ms)", lambda p: f"{p['step']['compute_s'] * 1e3:,.1f}"),
    ("  of it GEMMs + attention", lambda p: f"{p['step']['gemm_s'] * 1e3:,.1f}"),
    ("buffer copy-in / copy-out (ms)", lambda p: f"{p['step']['copy_s'] * 1e3:,.1f}"),
    ("exposed DP comm (ms)", lambda p: f"{p['step']['exposed_dp_s'] * 1e3:,.1f}"),
    ("  of it waiting on all-gathers", lambda p: f"{p['step']['exposed_all_gather_s'] * 1e3:,.1f}"),
    ("exposed TP/EP/CP/PP comm (ms)", lambda p: f"{p['step']['exposed_other_s'] * 1e3:,.1f}"),
    ("optimizer step (ms)", lambda p: f"{p['step']['optimizer_s'] * 1e3:,.1f}"),
    (
        "  Muon gathering every matrix instead (ms)",
        lambda p: f"{p['muon_gather_all_s'] * 1e3:,.1f}" if p["muon_gather_all_s"] else "-",
    ),
    ("tokens/s per device", lambda p: f"{p['step']['tokens_per_s_per_device']:,.0f}"),
)


def does_not_fit(plan: dict[str, Any]) -> list[str]:
    """One line per backend whose peak per rank exceeds the device's memory (the
    hardware profile's ``memory_gib``): such a plan's other figures describe a run
    that cannot happen."""
    limit = plan["hardware"].get("memory_gib", 0.0)
    lines = []
    for backend, p in plan["backends"].items():
        total = p["memory"]["total"]
        if limit and total > limit * GiB:
            lines.append(
                f"DOES NOT FIT: {backend} needs {_gib(total)} GiB per rank on "
                f"{plan['hardware']['name']} ({limit:g} GiB): its step and savings below "
                "are of a run that cannot happen"
            )
    return lines


def render(plan: dict[str, Any], top: int = 3) -> str:
    mesh = " x ".join(f"{k}={v}" for k, v in plan["mesh"].items() if v > 1 or k == "dp_shard")
    backends = list(plan["backends"])
    lines = [
        *does_not_fit(plan),
        f"world {plan['world']:,} ({mesh}), placement {plan['placement']}, "
        f"optimizer {plan['optimizer']}, {plan['parameters'] / 1e9:.1f}B parameters, "
        f"hardware {plan['hardware']['name']}; planned in {plan['planning_seconds']:.1f} s",
        "",
        "| per rank (busiest stage) | " + " | ".join(backends) + " |",
        "|---|" + "---|" * len(backends),
    ]
    for label, cell in ROWS:
        lines.append(
            f"| {label} | " + " | ".join(cell(plan["backends"][b]) for b in backends) + " |"
        )
    for backend in backends:
        p = plan["backends"][backend]
        lines += ["", f"{backend}: peak of gathered buffers: {p['memory']['gathered_detail']}"]
        biggest = sorted(p["buckets"], key=lambda b: -b["all_gather_bytes"])[:top]
        for b in biggest:
            lines.append(
                f"  {b['bucket']}: all-gather {_gib(b['all_gather_bytes'])} GiB "
                f"({b['all_gathers']}x), reduce-scatter {_gib(b['reduce_scatter_bytes'])} GiB, "
                f"padding {b['padding']:.1%}"
            )
        lines += [f"  note: {n}" for n in p["notes"]]
    return "\n".join(lines)


def _ms(x: float) -> str:
    return f"{x * 1e3:,.0f}"


#: the summary README.md and docs/planning.md print (``--markdown short`` / ``full``)
SUMMARY = (
    (
        "parameters / gradients / optimizer state (GiB)",
        lambda p: " / ".join(_gib(p["memory"][k]) for k in ("params", "grads", "optimizer")),
        True,
    ),
    (
        "gathered buffers in flight, worst moment (GiB)",
        lambda p: _gib(p["memory"]["gathered_peak"]),
        False,
    ),
    ("activations, worst moment (GiB)", lambda p: _gib(p["memory"]["activations"]), False),
    ("peak per rank: one moment's sum (GiB)", lambda p: _gib(p["memory"]["total"]), True),
    ("the moment", lambda p: p["memory"]["peak_moment"], True),
    (
        "then: gathered / activations / gradients (GiB)",
        lambda p: " / ".join(
            _gib(p["memory"]["at_peak"][k]) for k in ("gathered", "activations", "grads")
        ),
        False,
    ),
    ("each part's own peak, added (GiB)", lambda p: _gib(p["memory"]["sum_of_part_peaks"]), False),
    (
        "async checkpoint staging, host memory (GiB)",
        lambda p: _gib(p["memory"]["staging_host"]) if p["memory"]["staging_host"] else "-",
        False,
    ),
    ("bytes sent per step (GiB)", lambda p: _gib(p["bytes_per_step"]), True),
    ("max padding of a bucket", lambda p: f"{max(b['padding'] for b in p['buckets']):.1%}", False),
    (
        "step time / compute, of it GEMMs + attention (ms)",
        lambda p: (
            f"{_ms(p['step']['step_s'])} / {_ms(p['step']['compute_s'])}, "
            f"{_ms(p['step']['gemm_s'])}"
        ),
        True,
    ),
    ("buffer copy-in / copy-out (ms)", lambda p: _ms(p["step"]["copy_s"]), False),
    (
        "exposed data-parallel comm (ms), of it waiting on all-gathers",
        lambda p: f"{_ms(p['step']['exposed_dp_s'])}, {_ms(p['step']['exposed_all_gather_s'])}",
        False,
    ),
    ("exposed TP / EP / CP / PP comm (ms)", lambda p: _ms(p["step"]["exposed_other_s"]), False),
    ("optimizer step (ms)", lambda p: _ms(p["step"]["optimizer_s"]), False),
    ("tokens/s per GPU (model)", lambda p: f"{p['step']['tokens_per_s_per_device']:,.0f}", True),
)


def render_summary(plan: dict[str, Any], full: bool = True) -> str:
    """The plan as the docs print it: deterministic (no planning time), one column per
    backend; ``full`` False keeps the README's rows."""
    names = {"flexshard": f"flexshard ({plan['placement']})", "fsdp2": "FSDP2"}
    backends = list(plan["backends"])
    lines = [
        *does_not_fit(plan),
        "| per rank (busiest) | " + " | ".join(names.get(b, b) for b in backends) + " |",
        "|---|" + "---|" * len(backends),
    ]
    for label, cell, short in SUMMARY:
        if full or short:
            cells = " | ".join(cell(plan["backends"][b]) for b in backends)
            lines.append(f"| {label} | {cells} |")
    return "\n".join(lines)
