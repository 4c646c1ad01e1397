"""``flexshard-plan`` end to end: the table, the JSON (its parts add up), the sweep
plot, --suggest and the errors a user gets."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from flexshard.plan.cli import main

DEBUG = "configs/debug.toml"


def test_plan_json_adds_up(tmp_path, capsys) -> None:
    out = tmp_path / "plan.json"
    rc = main([DEBUG, "--world", "1024", "--json", str(out), "--model.ffn_hidden", "170"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "| total per rank (GiB): peak of one moment |" in text and "fsdp2" in text
    plan = json.loads(out.read_text())
    assert plan["world"] == 1024 and plan["mesh"]["dp_shard"] == 1024
    for backend in ("flexshard", "fsdp2"):
        p = plan["backends"][backend]
        m = p["memory"]
        # the total is one moment's sum, below the sum of each part's own worst moment
        assert m["total"] == sum(m["at_peak"].values())
        parts = ("params", "grads", "optimizer", "gathered_peak", "activations")
        assert m["total"] < m["sum_of_part_peaks"] == sum(m[k] for k in parts)
        assert m["activations"] > 0 and m["gathered_peak"] > 0
        assert m["staging_host"] == 0  # no checkpoints in this config
        sent = sum(b["all_gather_bytes"] + b["reduce_scatter_bytes"] for b in p["buckets"])
        assert p["bytes_per_step"] == sent
        step = p["step"]
        assert step["step_s"] >= step["compute_s"] + step["optimizer_s"]
        assert step["tokens_per_s_per_device"] > 0
    # the trainer passes reshard_after_forward = true to FSDP2's root too, which then
    # re-gathers it in backward like flexshard's (tests/plan/test_plan_terms.py counts
    # torch's calls): two all-gathers each
    roots = {b: plan["backends"][b]["buckets"][-1] for b in ("flexshard", "fsdp2")}
    assert roots["flexshard"]["all_gathers"] == 2 and roots["fsdp2"]["all_gathers"] == 2


@pytest.mark.parametrize("name", ["qwen3_8b", "qwen3_moe_30b_a3b"])
def test_plan_runs_on_the_qwen3_shapes(name, tmp_path) -> None:
    out = tmp_path / "plan.json"
    assert main([f"configs/{name}.toml", "--world", "8", "--json", str(out)]) == 0
    for p in json.loads(out.read_text())["backends"].values():
        assert p["memory"]["params"] > 0 and p["step"]["tokens_per_s_per_device"] > 0


def test_sweep_plot(tmp_path, capsys) -> None:
    png = tmp_path / "sweep.png"
    rc = main(
        [DEBUG, "--world", "64", "--sweep", "8,64", "--plot", str(png), "--dp-backend", "flexshard"]
    )
    assert rc == 0 and png.stat().st_size > 0
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| 8 ")]
    assert rows, "no sweep row for W = 8"


def test_suggest_prefers_a_fitting_option(capsys) -> None:
    rc = main(
        [
            DEBUG,
            "--world",
            "256",
            "--suggest",
            "--memory-limit",
            "1",
            "--training.optimizer",
            "muon",
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "suggested:" in text and "placement muon" in text and "placement owned" in text
    rc = main([DEBUG, "--world", "256", "--suggest", "--memory-limit", "0.000001"])
    assert "no option fits" in capsys.readouterr().out


def test_errors_name_the_problem(capsys) -> None:
    assert main([DEBUG, "--world", "8", "--parallelism.tp", "3"]) == 2
    assert "parallelism.tp" in capsys.readouterr().err
    assert main([DEBUG, "--world", "8", "--hardware", "tpu9"]) == 2
    assert "tpu9" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, named",
    [
        (["--sweep", "2,x"], "'x'"),
        (["--sweep", "8,-4"], "-4"),
        (["--suggest", "--memory-limit", "-1"], "--memory-limit -1"),
        (["--suggest", "--memory-limit", "0"], "--memory-limit 0"),
        (["--world", "0"], "--world 0"),
    ],
)
def test_bad_arguments_are_one_line(args: list[str], named: str) -> None:
    """The command as a user runs it: exit 2, one line naming the value, no traceback."""
    if "--world" not in args:
        args = ["--world", "8", *args]
    run = subprocess.run(
        [sys.executable, "-m", "flexshard.plan", DEBUG, *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr + run.stdout
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and named in lines[0], run.stderr


def test_a_plan_that_does_not_fit_says_so_first(tmp_path, capsys) -> None:
    """The device's memory in the profile: a plan above it is marked in its first line,
    for each backend, and one within it is not."""
    profile = tmp_path / "small.json"
    assert main([DEBUG, "--world", "8", "--json", str(tmp_path / "plan.json")]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("world 8"), first
    hardware = json.loads((tmp_path / "plan.json").read_text())["hardware"]
    profile.write_text(json.dumps({**hardware, "name": "small", "memory_gib": 0.001}))
    assert main([DEBUG, "--world", "8", "--hardware", str(profile)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("DOES NOT FIT: flexshard needs"), lines[0]
    assert lines[1].startswith("DOES NOT FIT: fsdp2 needs"), lines[1]
    assert "(0.001 GiB)" in lines[0]


def test_muon_plan_names_what_it_redistributes(capsys) -> None:
    """Under Muon the trainer's default layout owns what it can; the plan says how many
    matrices its step moves, and the FSDP2 column moves them all."""
    assert main(["configs/llama3_8b.toml", "--world", "64", "--training.optimizer", "muon"]) == 0
    text = capsys.readouterr().out
    assert "placement muon" in text.splitlines()[0]
    ours, fsdp2 = [line for line in text.splitlines() if "note: Muon:" in line]
    # 7 matrices a block, 32 blocks: what fits under the storage cap is owned
    assert "192 matrices stepped where stored, 32 too large" in ours, ours
    assert "0 matrices stepped where stored, 224 too large" in fsdp2, fsdp2
