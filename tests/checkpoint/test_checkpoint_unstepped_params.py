"""Parameters no gradient ever reaches (DeepSeek-V4's indexer, chosen by a top-k) have
no optimizer state when a checkpoint is saved: the checkpoint loads into a fresh
optimizer as it was saved (those parameters without state, the others exact), and a
parameter the saved optimizer did not know still raises."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flexshard import checkpoint as ckpt


class PartlyUsed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(6, 5)
        self.unused = nn.Linear(6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def _built(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = PartlyUsed()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(seed))
    model(x).square().sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_unstepped_parameters_load_without_state_and_training_continues(tmp_path):
    model, optimizer = _built(0)
    for step in range(2):
        _step(model, optimizer, step)
    ckpt.save(tmp_path / "ckpt", model, optimizer)
    _step(model, optimizer, 2)  # the uninterrupted run

    resumed, resumed_optimizer = _built(1)
    ckpt.load(tmp_path / "ckpt", resumed, resumed_optimizer)
    assert all(p not in resumed_optimizer.state for p in resumed.unused.parameters())
    assert all(p in resumed_optimizer.state for p in resumed.used.parameters())
    _step(resumed, resumed_optimizer, 2)
    for (name, a), b in zip(model.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name


def test_a_parameter_the_saved_optimizer_did_not_know_raises(tmp_path):
    model, _ = _built(0)
    optimizer = torch.optim.AdamW(model.used.parameters(), lr=1e-2)  # not of ``unused``
    _step(model, optimizer, 0)
    ckpt.save(tmp_path / "ckpt", model, optimizer)
    resumed, every_parameter = _built(1)
    with pytest.raises(ValueError, match="param groups"):
        ckpt.load(tmp_path / "ckpt", resumed, every_parameter)
