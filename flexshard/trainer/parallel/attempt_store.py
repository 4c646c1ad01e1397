"""A key/value store of this restart attempt's own, under torchrun.

Since torch 2.5 torchrun's agent hosts one TCPStore for the whole job and hands its
address to the workers (``TORCHELASTIC_USE_AGENT_STORE=True``); a restart reuses it
with every key the killed attempt wrote. The process group of the restarted workers
then reads the dead workers' addresses and fails to form (pytorch/pytorch#135712).
A key prefix per ``TORCHELASTIC_RESTART_COUNT`` does not cure it: that count is each
agent's own, and the agents of two nodes disagree as soon as one restarts for a
failure of its own workers and the other for the new rendezvous round.

So rank 0 of every attempt starts a fresh TCPStore on a free port and publishes
``port nonce`` in the agent's store; the other ranks connect to it and check the
nonce. A stale entry names the previous attempt's rank 0, which is dead (every agent
stops its workers before the next rendezvous round completes), so its port refuses
the connection or answers another nonce, and the rank reads the entry again. Nothing
of the previous attempt is read, whatever the restart counts say.
"""

from __future__ import annotations

import datetime
import os
import time
import uuid

import torch.distributed as dist

PUBLISHED = "attempt_store"  # key in the agent's store: "<port> <nonce>"
NONCE = "flexshard_attempt"  # key in the fresh store: the nonce it was published with
PROBE_S = 2.0  # how long one connection attempt to a published store may take


def uses_agent_store() -> bool:
    """True for workers torchrun started with its shared store (the default since 2.5)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def attempt_store(timeout: datetime.timedelta) -> dist.Store:
    """This attempt's own store (rank 0 hosts it); every wait bounded by ``timeout``."""
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    # the agent's store hosts its own keys too: ours under the run's name
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    agent = dist.PrefixStore(f"flexshard/{run_id}/", _agent_store(timeout))
    if rank == 0:
        return _host(agent, world_size, timeout)
    return _join(agent, timeout)


def _agent_store(timeout: datetime.timedelta) -> dist.TCPStore:
    return dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timeout,
    )


def _host(agent: dist.Store, world_size: int, timeout: datetime.timedelta) -> dist.TCPStore:
    # port 0: the kernel picks a free one (no race with other jobs for a fixed port);
    # no waiting for the clients here, the process group's rendezvous waits for them
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],  # the server listens on every interface; this is its
        0,  # own client's address
        world_size=world_size,
        is_master=True,
        timeout=timeout,
        wait_for_workers=False,
    )
    nonce = uuid.uuid4().hex
    store.set(NONCE, nonce)
    agent.set(PUBLISHED, f"{store.port} {nonce}")
    return store


def _join(agent: dist.Store, timeout: datetime.timedelta) -> dist.TCPStore:
    # rank 0 runs on the node torchrun's agent store runs on: MASTER_ADDR reaches both
    host = os.environ["MASTER_ADDR"]
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        port, nonce = agent.get(PUBLISHED).decode().split()  # blocks until rank 0 wrote it
        try:
            probe = datetime.timedelta(seconds=PROBE_S)
            store = dist.TCPStore(host, int(port), is_master=False, timeout=probe)
            if store.get(NONCE).decode() == nonce:
                store.set_timeout(timeout)
                return store
        except (RuntimeError, dist.DistError):
            pass  # the previous attempt's rank 0 (dead) or someone else's port
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"flexshard: rank 0's store of this restart attempt did not answer within "
                f"{timeout.total_seconds():.0f} s (last published: {host}:{port})"
            )
        time.sleep(0.1)
