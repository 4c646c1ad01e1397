"""``flexshard-plan --suggest``: plan the config under each placement family, bucket
grouping and reshard policy the trainer offers, keep those under the memory limit,
rank them by predicted step time (exposed communication), and say why."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from flexshard.trainer.config import Config, ConfigError
from flexshard.trainer.config.validation import validate

from .hardware import Hardware
from .host_costs import NO_HOST_COSTS, HostCosts
from .report import make_plan

GiB = 2**30


@dataclass
class Candidate:
    label: str
    cfg: Config
    why: str


def _with(cfg: Config, **parallelism: Any) -> Config:
    out = copy.deepcopy(cfg)
    for key, value in parallelism.items():
        setattr(out.parallelism, key, value)
    return out


def _grouped_buckets(cfg: Config, blocks: int, placement: str) -> list[dict[str, Any]]:
    """Explicit buckets of ``blocks`` consecutive blocks each, plus the root's parts."""
    n = cfg.model.n_layers
    groups = [
        {
            "name": f"layers.{i}-{min(i + blocks, n) - 1}",
            "patterns": [f"layers.{j}.*" for j in range(i, min(i + blocks, n))],
            "placement": placement,
        }
        for i in range(0, n, blocks)
    ]
    outer = ["tok_embeddings.*", "norm.*", "output.*"]
    return [*groups, {"name": "outer", "patterns": outer, "placement": placement}]


def candidates(cfg: Config) -> list[Candidate]:
    par = cfg.parallelism
    composed = par.tp * par.pp * par.ep > 1
    out = [Candidate("as configured", cfg, "the config unchanged")]
    families = {
        "shard0": "FSDP2's rows: no padding beyond the torch.chunk rule",
        "flat": "FSDP1's flat split: the least padding, parameters straddle ranks",
        "owned": "whole matrices per rank: Muon and matrix optimizers run without moving a byte",
        "mixed": "norms flat, attention in head row blocks, SwiGLU inputs owned",
    }
    for name, why in families.items():
        if name != par.placement:
            out.append(Candidate(f"placement {name}", _with(cfg, placement=name), why))
    out.append(
        Candidate(
            "placement block 128x128",
            _with(cfg, placement="block", block=[128, 128]),
            "whole FP8 128x128 tiles per rank: each rank quantizes its own tiles",
        )
    )
    if not composed and cfg.training.optimizer == "muon":
        out.append(
            Candidate(
                "placement muon",
                _with(cfg, placement="muon"),
                "Owned / head row blocks balanced by LPT on Newton-Schulz FLOPs",
            )
        )
    out.append(
        Candidate(
            "no reshard after forward",
            _with(cfg, reshard_after_forward=not par.reshard_after_forward),
            "one all-gather per bucket per step instead of two, at the cost of keeping "
            "every block gathered from forward to backward",
        )
    )
    out += _ac_candidates(cfg)
    if not composed and not par.buckets and par.placement != "muon":
        for blocks in (2, 4):
            if cfg.model.n_layers >= 2 * blocks:
                grouped = _with(cfg, buckets=_grouped_buckets(cfg, blocks, par.placement))
                out.append(
                    Candidate(
                        f"{blocks} blocks per bucket",
                        grouped,
                        f"{blocks}x fewer collectives: less ring latency at large W, "
                        "larger gathered buffers",
                    )
                )
    return out


AC_MODES = {
    ("selective", "op"): "keep matmul outputs, recompute the elementwise rest (little compute)",
    ("selective", "2"): "recompute every 2nd block: half the blocks keep only their input",
    ("full", "op"): "recompute every block: each keeps only its input (one more forward)",
}


def _ac_candidates(cfg: Config) -> list[Candidate]:
    """Activation checkpointing modes other than the configured one."""
    ac = cfg.activation_checkpoint
    out = []
    for (mode, option), why in AC_MODES.items():
        if (ac.mode, ac.selective_ac_option) == (mode, option) or (ac.mode == mode == "full"):
            continue
        changed = copy.deepcopy(cfg)
        changed.activation_checkpoint.mode = mode  # type: ignore[assignment]
        changed.activation_checkpoint.selective_ac_option = option
        label = f"activation checkpoint {mode}" + ("" if mode == "full" else f" {option}")
        out.append(Candidate(label, changed, why))
    return out


def evaluate(
    cfg: Config, world: int, hw: Hardware, limit_gib: float, host: HostCosts = NO_HOST_COSTS
) -> list[dict[str, Any]]:
    rows = []
    for cand in candidates(cfg):
        try:
            validate(cand.cfg)
            plan = make_plan(cand.cfg, world, hw, None, ("flexshard",), host)
        except (ConfigError, ValueError) as err:
            rows.append({"label": cand.label, "error": str(err), "why": cand.why})
            continue
        p = plan["backends"]["flexshard"]
        rows.append(
            {
                "label": cand.label,
                "why": cand.why,
                "memory_gib": p["memory"]["total"] / GiB,
                "activations_gib": p["memory"]["activations"] / GiB,
                "fits": p["memory"]["total"] <= limit_gib * GiB,
                "step_ms": p["step"]["step_s"] * 1e3,
                "exposed_ms": (p["step"]["exposed_dp_s"] + p["step"]["exposed_other_s"]) * 1e3,
                "padding": max(b["padding"] for b in p["buckets"]),
                "muon_imbalance": p["muon"]["imbalance"] if p["muon"] else None,
                "muon_a2a_gib": p["muon"]["all_to_all_bytes"] / GiB if p["muon"] else None,
            }
        )
    return rows


def suggest(
    cfg: Config, world: int, hw: Hardware, limit_gib: float, host: HostCosts = NO_HOST_COSTS
) -> str:
    rows = evaluate(cfg, world, hw, limit_gib, host)
    ok = sorted((r for r in rows if "error" not in r), key=lambda r: (not r["fits"], r["step_ms"]))
    lines = [
        f"suggestions for W = {world:,} on {hw.name}, memory limit {limit_gib:g} GiB per device",
        "",
        "| option | fits | GiB/rank | step ms | exposed comm ms | max padding | Muon max/mean |"
        " Muon a2a GiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in ok:
        muon = f"{r['muon_imbalance']:.3f}" if r["muon_imbalance"] else "-"
        a2a = f"{r['muon_a2a_gib']:.2f}" if r["muon_a2a_gib"] is not None else "-"
        lines.append(
            f"| {r['label']} | {'yes' if r['fits'] else 'no'} | {r['memory_gib']:.2f} | "
            f"{r['step_ms']:,.1f} | {r['exposed_ms']:,.1f} | {r['padding']:.1%} | {muon} | {a2a} |"
        )
    lines.append("")
    fitting = [r for r in ok if r["fits"]]
    if fitting:
        best = fitting[0]
        lines.append(f"suggested: {best['label']} ({best['why']}).")
        base = next((r for r in ok if r["label"] == "as configured"), None)
        if base is not None and best is not base:
            lines.append(
                f"  vs as configured: step {base['step_ms']:,.1f} -> {best['step_ms']:,.1f} ms, "
                f"memory {base['memory_gib']:.2f} -> {best['memory_gib']:.2f} GiB per rank."
            )
    else:
        worst = min(ok, key=lambda r: r["memory_gib"]) if ok else None
        lines.append(f"no option fits {limit_gib:g} GiB per device.")
        if worst is not None:
            lines.append(
                f"  the smallest needs {worst['memory_gib']:.1f} GiB, of which activations "
                f"{worst['activations_gib']:.1f} GiB: raise tp or pp, shorten "
                "training.seq_len or training.batch_size."
            )
    for r in rows:
        if "error" in r:
            lines.append(f"  not possible: {r['label']}: {r['error']}")
    return "\n".join(lines)
