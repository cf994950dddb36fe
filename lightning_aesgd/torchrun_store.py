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

The strategy's other process-group and process chores live here too: creating its group on such a store
(:func:`init_attempt_group`), destroying it first at exit (:func:`destroy_group_at_exit`), and ending the
replicas a script launcher started when the job cannot go on (:func:`end_launched_replicas`).
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lightning_aesgd.placement import bound_device

log = logging.getLogger(__name__)

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


def destroy_group_at_exit() -> None:
    """Register :func:`destroy_process_group` to run at interpreter exit, once per process.

    A group left to the interpreter's exit may abort the process after a successful fit ("terminate called without
    an active exception": gloo's threads outlive the group's destruction order at shutdown), which a launcher counts
    as a failure. Destroyed first at exit instead; forked replicas leave by ``os._exit``.
    """
    if not getattr(destroy_group_at_exit, "registered", False):
        atexit.register(destroy_process_group)
        destroy_group_at_exit.registered = True  # type: ignore[attr-defined]


def init_attempt_group(strategy: Any) -> None:
    """Create the default group of a Lightning ``DDPStrategy`` on this attempt's own store, where it needs one.

    Where :func:`attempt_store` applies (a single-node torchrun sharing its agent's store), the group is created
    here as Lightning's ``_init_dist_connection`` creates it, but on that store instead of ``env://``; Lightning's
    own set-up then finds it initialised and keeps it. Rank zero logs :func:`shared_store_warning` where it applies.

    Args:
        strategy: the strategy about to set up its process group (of either Lightning namespace).
    """
    warning = shared_store_warning()
    if warning is not None and strategy.global_rank == 0:
        log.warning(warning)
    store = attempt_store(strategy._timeout)
    if store is None or dist.is_initialized():
        return
    strategy.set_world_ranks()
    environment, backend = strategy.cluster_environment, strategy._get_process_group_backend()
    dist.init_process_group(
        backend,
        store=store,
        rank=environment.global_rank(),
        world_size=environment.world_size(),
        timeout=strategy._timeout,
        device_id=bound_device(backend, strategy.root_device),
    )


def end_launched_replicas(launcher: Any) -> None:
    """Kill the processes a script launcher started (Lightning's own answer to a failed child: SIGKILL).

    Under the script launcher rank zero starts the other ranks; Lightning ends them when a child fails, but when
    rank zero fails first (its merge timed out because a child stalls, or the rendezvous failed) the child would
    live on as an orphan until it wakes. torchrun, the spawn launcher and SLURM end their processes themselves.
    """
    children = getattr(launcher, "procs", None)
    if not children:
        return
    # SIGTERM is not enough: a process blocked in a collective or a C extension may never handle it.
    kill = getattr(signal, "SIGKILL", signal.SIGTERM)
    for child in children:
        if child.poll() is None:
            log.error("Ending replica process %d, launched by this one, as the job cannot go on.", child.pid)
            child.send_signal(kill)
