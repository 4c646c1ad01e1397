"""``flexshard-plan`` end to end: the table, the JSON (its parts add up), the sweep
plot, --suggest and the errors a user gets."""

from __future__ import annotations

import json

from flexshard.plan.cli import main

DEBUG = "configs/debug.toml"


def test_plan_json_adds_up(tmp_path, capsys) -> None:
    out = tmp_path / "plan.json"
    rc = main([DEBUG, "--world", "1024", "--json", str(out), "--model.ffn_hidden", "170"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "| total per rank (GiB) |" in text and "fsdp2" in text
    plan = json.loads(out.read_text())
    assert plan["world"] == 1024 and plan["mesh"]["dp_shard"] == 1024
    for backend in ("flexshard", "fsdp2"):
        p = plan["backends"][backend]
        m = p["memory"]
        parts = ("params", "grads", "optimizer", "gathered_peak", "activations")
        assert m["total"] == sum(m[k] for k in parts)
        assert m["activations"] > 0 and m["gathered_peak"] > 0
        sent = sum(b["all_gather_bytes"] + b["reduce_scatter_bytes"] for b in p["buckets"])
        assert p["bytes_per_step"] == sent
        step = p["step"]
        assert step["step_s"] >= step["compute_s"] + step["optimizer_s"]
        assert step["tokens_per_s_per_device"] > 0
    # the trainer passes reshard_after_forward = true to FSDP2's root too, which then
    # re-gathers it in backward like flexshard's (tests/test_plan_terms.py counts
    # torch's calls): two all-gathers each
    roots = {b: plan["backends"][b]["buckets"][-1] for b in ("flexshard", "fsdp2")}
    assert roots["flexshard"]["all_gathers"] == 2 and roots["fsdp2"]["all_gathers"] == 2


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
