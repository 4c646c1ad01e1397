"""benchmarks/gpu_check.py (the prepared GPU check, unrun without a GPU): its dry run on
CPU/gloo runs every check with tiny shapes and writes the JSON and Markdown."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_dry_run_writes_every_check(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", str(tmp_path), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).parents[2],
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((tmp_path / "gpu_check_w1.json").read_text())["rows"][0]
    checks = ["parity_fp32", "parity_bf16", "speed", "trace", "quantized_gather", "dist_muon"]
    checks.append("unused_grads")
    assert sorted(results) == sorted(checks)
    assert all(results[name]["ok"] for name in checks), results
    assert results["parity_bf16"]["losses_flexshard"] == results["parity_bf16"]["losses_fsdp2"]
    assert "| quantized_gather | yes |" in (tmp_path / "gpu_check_w1.md").read_text()
    assert (tmp_path / "trace_rank0.json").exists()
