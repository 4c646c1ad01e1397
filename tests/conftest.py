"""The suite's ranks start from a forkserver that imported torch and flexshard once
(``flexshard.testing.launch``): each launch then costs a fork instead of every rank's
interpreter start and imports (seconds each on two cores), with the same fresh module
state as spawn. Set before any launch, so the server starts with this environment."""

import os

import pytest
import torch.distributed as dist

from flexshard.testing.launch import START_METHOD_ENV
from flexshard.trainer.launch import free_port

os.environ.setdefault(START_METHOD_ENV, "forkserver")


@pytest.fixture(scope="module")
def one_rank_group():
    """A one-process gloo group in the test process (no spawn), for cases about the
    error or work of one rank."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    yield dist.group.WORLD
    dist.destroy_process_group()
