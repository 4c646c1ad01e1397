"""What a user watches: per-step metrics to JSONL (and TensorBoard when installed), a
rank-0 progress bar (tqdm), a final summary table and a PNG loss curve."""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import torch

# dense bf16 peak per GPU, for the MFU estimate
GPU_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}


def peak_flops_per_rank(device: torch.device, configured_tflops: float) -> float:
    """FLOP/s one rank could reach: the config's value, a known GPU's datasheet peak,
    or on CPU a short fp32 matmul probe on this process's threads."""
    if configured_tflops > 0:
        return configured_tflops * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, tflops in GPU_PEAK_TFLOPS.items():
            if key in name:
                return tflops * 1e12
        return 0.0
    n = 256
    a, b = torch.randn(n, n), torch.randn(n, n)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def peak_memory_mb(device: torch.device) -> float:
    """Peak allocated device memory (CUDA) or this process's peak resident set size
    (CPU: Linux VmHWM, which ``/proc/self/clear_refs`` can reset; else ru_maxrss), MB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


class ProgressBar:
    """Rank 0's bar on stderr: ``tqdm``'s (rate, ETA, redraws at most ten times a
    second), with the loss and tokens/s of the last step beside it."""

    def __init__(self, total: int, initial: int = 0, stream: TextIO = sys.stderr) -> None:
        try:
            from tqdm import tqdm
        except ImportError:
            raise ImportError(
                "job.progress = true needs the tqdm package (pip install tqdm, or the "
                "`train` extra); or set --job.progress false"
            ) from None
        self.bar = tqdm(
            total=total, initial=initial, file=stream, unit="step", dynamic_ncols=True, leave=True
        )

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        self.bar.set_postfix_str(f"loss {loss:.4f}, {tokens_per_s:,.0f} tok/s", refresh=False)
        self.bar.update(step - self.bar.n)

    def close(self) -> None:
        self.bar.close()


class MetricsWriter:
    """Rank 0 writes one JSON object per step to ``metrics.jsonl`` and, if the
    ``tensorboard`` package is importable, the scalars to ``dump_folder/tb``."""

    def __init__(self, folder: Path, tensorboard: bool, append: bool) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / "metrics.jsonl"
        self.file = self.path.open("a" if append else "w")
        self.tb: Any = None
        self.note = ""
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(folder / "tb"))
            except ImportError:
                self.note = "TensorBoard skipped: the tensorboard package is not installed"

    def log(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tb is not None:
            for key, value in record.items():
                if isinstance(value, int | float) and key != "step":
                    self.tb.add_scalar(key, value, record["step"])

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl; a resumed run's repeated steps: the later wins."""
    by_step: dict[int, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            by_step[record["step"]] = record
    return [by_step[s] for s in sorted(by_step)]


def summary_table(records: list[dict[str, Any]], header: dict[str, Any]) -> str:
    """A plain-text table of the run: set-up, then first/last/best of each metric."""
    lines = [f"{k:<22} {v}" for k, v in header.items()]
    if not records:
        return "\n".join(lines)
    timed = records[1:] or records  # the first step includes warm-up work
    tps = sorted(r["tokens_per_s"] for r in timed)
    lines += [
        f"{'steps':<22} {records[0]['step']}..{records[-1]['step']}",
        f"{'loss first -> last':<22} {records[0]['loss']:.4f} -> {records[-1]['loss']:.4f}"
        f"  (best {min(r['loss'] for r in records):.4f})",
        f"{'tokens/s (median)':<22} {tps[len(tps) // 2]:,.0f}",
        f"{'MFU (median)':<22} {sorted(r['mfu'] for r in timed)[len(timed) // 2]:.2%}",
        f"{'peak memory MB':<22} {max(r['peak_memory_mb'] for r in records):.1f}",
        f"{'grad norm last':<22} {records[-1]['grad_norm']:.4f}",
    ]
    if "reward" in records[0]:  # RL: noisy per step, so the first and last tenth's means
        tenth = max(1, len(records) // 10)
        for key in ("reward", "solved"):
            first = sum(r[key] for r in records[:tenth]) / tenth
            last = sum(r[key] for r in records[-tenth:]) / tenth
            lines.append(
                f"{key + ' first -> last':<22} {first:.3f} -> {last:.3f}"
                f"  (means of {tenth} steps each)"
            )
    validated = [r for r in records if "val_loss" in r]
    if validated:
        last = validated[-1]
        lines.append(
            f"{'validation loss':<22} {last['val_loss']:.4f} at step {last['step']}"
            f"  (perplexity {last['val_perplexity']:.2f})"
        )
    loads = records[-1].get("tokens_per_expert")
    if loads:  # MoE balance: the busiest expert against the mean, worst layer
        worst = max(max(v) * len(v) / max(sum(v), 1) for v in loads.values())
        lines.append(f"{'expert load max/mean':<22} {worst:.2f} (last step, worst layer)")
    comm = records[-1].get("comm_bytes")
    if comm:
        lines.append(
            f"{'comm MB/step (last)':<22} "
            + ", ".join(f"{name} {value / 1e6:.3f}" for name, value in comm.items())
        )
    width = max(len(line) for line in lines)
    return "\n".join(["=" * width, *lines, "=" * width])


def plot_losses(records: list[dict[str, Any]], path: Path, title: str) -> str:
    """Loss (and lr) against step as a PNG; returns a note when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "loss plot skipped: matplotlib is not installed (pip install matplotlib)"
    steps = [r["step"] for r in records]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r["loss"] for r in records], label="loss", color="tab:blue")
    validated = [r for r in records if "val_loss" in r]
    if validated:
        val_steps, val_losses = [r["step"] for r in validated], [r["val_loss"] for r in validated]
        ax.plot(val_steps, val_losses, "o-", label="validation loss", color="tab:green")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    lr_axis = ax.twinx()
    lr_axis.plot(steps, [r["lr"] for r in records], color="tab:orange", alpha=0.5, label="lr")
    lr_axis.set_ylabel("learning rate")
    lines = ax.get_lines() + lr_axis.get_lines()
    ax.legend(lines, [line.get_label() for line in lines], loc="upper center")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"loss curve: {path}"
