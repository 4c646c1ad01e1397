"""What an import costs: ``import flexshard`` loads no torch (its names load on first
use) and none of torch's test utilities, and every command line prints ``--help``
without importing torch. Each case runs in a fresh interpreter: this process has
long since imported everything."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def loaded_after(code: str) -> list[str]:
    """The modules a fresh interpreter holds after running ``code``."""
    report = "import json, sys; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", f"{code}\n{report}"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout
    return json.loads(out.splitlines()[-1])


def torch_testing(modules: list[str]) -> set[str]:
    return {m for m in modules if m.startswith("torch.testing._internal")}


def test_import_flexshard_loads_no_torch() -> None:
    modules = loaded_after("import flexshard")
    assert "torch" not in modules
    assert not torch_testing(modules)


def test_every_public_name_loads_no_more_of_torchs_test_utilities_than_fsdp2() -> None:
    """Reading every public name loads of torch.testing only what torch's own FSDP2
    and DCP load themselves (torch.distributed.fsdp imports its fake process group)."""
    everything = loaded_after(
        "import flexshard as fs\nfrom flexshard import *\nfs.checkpoint.save, fs.optim.DistMuon"
    )
    assert "flexshard.fsdp.api" in everything and "flexshard.optim.dist_muon" in everything
    fsdp2 = loaded_after("import torch.distributed.fsdp, torch.distributed.checkpoint")
    assert torch_testing(everything) <= torch_testing(fsdp2)


def test_the_library_never_loads_the_test_helpers() -> None:
    everything = loaded_after("import flexshard as fs\nfrom flexshard import *\nfs.checkpoint")
    assert not [m for m in everything if m.startswith("flexshard.testing")]


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_help_prints_without_torch(script: str) -> None:
    module, function = SCRIPTS[script].split(":")
    code = (
        f"import contextlib, io, sys\nfrom {module} import {function} as main\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):\n"
        "    main(['--help'])\n"
        "assert out.getvalue().startswith('usage: " + script + "'), out.getvalue()[:200]"
    )
    assert "torch" not in loaded_after(code)


def test_sharding_a_model_loads_no_checkpoint_machinery() -> None:
    """torch.distributed.checkpoint loads when a checkpoint is saved or loaded, not
    with the sharding API (a state dict's chunks import DCP's types when DCP asks)."""
    modules = loaded_after("from flexshard import BucketSpec, Shard, flex_shard, fully_shard")
    assert "flexshard.fsdp.api" in modules
    assert "torch.distributed.checkpoint" not in modules
    assert not [m for m in modules if m.startswith(("flexshard.checkpoint", "flexshard.optim"))]
