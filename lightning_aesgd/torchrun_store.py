"""Process groups that survive torchrun's restarts (``--max-restarts``).

torchrun's c10d rendezvous (``--standalone`` and ``--rdzv-backend=c10d``, by default) hosts one TCP store in
the elastic agent and hands its address to every worker as ``MASTER_ADDR``/``MASTER_PORT`` with
``TORCHELASTIC_USE_AGENT_STORE=True``. torch keeps that store for the agent's whole life, across restarts, yet
``init_process_group`` writes the same keys in every attempt (``default_pg/0/...``: gloo's peer addresses, the
store barrier's counters). A restarted worker may then read what a dead worker of the previous attempt wrote:
gloo connects to an address nobody listens on any more (``connectFullMesh ... Connection refused``) or the
barrier waits for a count that was already passed (a hang until the timeout). Whether a try works depends on
which worker writes its key first, which is why the same command sometimes resumes and sometimes does not.

On one node the agent's restart count is the same for every worker, so keys prefixed by it are fresh in every
attempt: :func:`attempt_store` builds that store. Across nodes each agent counts its own restarts (pytorch issue
135712), so no prefix is safe there; ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` makes torchrun start a fresh
store for every rendezvous round instead, and :func:`shared_store_warning` says so.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch.distributed as dist

RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
USE_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
DISABLE_SHARING = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def _shares_agent_store(env: Mapping[str, str]) -> bool:
    return env.get(USE_AGENT_STORE) == "True" and RESTART_COUNT in env and "MASTER_PORT" in env


def _single_node(env: Mapping[str, str]) -> bool:
    return env.get("GROUP_WORLD_SIZE", "1") == "1"


def attempt_prefix(env: Mapping[str, str]) -> str | None:
    """The key prefix that isolates this torchrun attempt in the agent's store; ``None`` where none is needed.

    Only a single-node torchrun job sharing the agent's store gets one: there the restart count is the same for
    every worker of an attempt and new in every attempt.

    >>> attempt_prefix({"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "2",
    ...                 "MASTER_PORT": "29500", "GROUP_WORLD_SIZE": "1"})
    'aesgd/attempt_2'
    >>> attempt_prefix({"MASTER_PORT": "29500"}) is None  # not torchrun
    True
    """
    if not _shares_agent_store(env) or not _single_node(env):
        return None
    return f"aesgd/attempt_{env[RESTART_COUNT]}"  # PrefixStore adds the "/"


def attempt_store(timeout: timedelta | None, env: Mapping[str, str] | None = None) -> Any:
    """A client of torchrun's agent store whose keys are this attempt's own; ``None`` outside that case.

    Args:
        timeout: how long store operations wait (the strategy's ``timeout``).
        env: the environment (``os.environ`` by default).
    """
    env = os.environ if env is None else env
    prefix = attempt_prefix(env)
    if prefix is None:
        return None
    # torch.distributed's own classes, typed here; imported late, as builds without distributed lack them.
    from torch._C._distributed_c10d import PrefixStore, TCPStore

    store = TCPStore(
        env.get("MASTER_ADDR", "localhost"),
        int(env["MASTER_PORT"]),
        is_master=False,  # the agent hosts it
        timeout=timeout if timeout is not None else timedelta(minutes=30),
    )
    return PrefixStore(prefix, store)


def shared_store_warning(env: Mapping[str, str] | None = None) -> str | None:
    """Why a multi-node torchrun job with restarts may fail to restart, and the fix; ``None`` where it cannot."""
    env = os.environ if env is None else env
    restarts = int(env.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    if not _shares_agent_store(env) or _single_node(env) or restarts == 0 or env.get(DISABLE_SHARING) == "1":
        return None
    return (
        "torchrun shares its agent's store with the workers across restarts, and on several nodes the workers "
        "cannot tell attempts apart: a restarted group may read a dead worker's address and fail or hang in "
        f"init_process_group. HINT: launch with {DISABLE_SHARING}=1 in the environment of every torchrun (a fresh "
        "store per rendezvous round)."
    )


def destroy_process_group() -> None:
    """Destroy the default process group if one is left: registered at exit for the groups the strategy creates."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
