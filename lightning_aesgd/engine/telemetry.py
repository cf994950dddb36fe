"""What the strategy reports: per-replica metrics for Lightning's loggers and an end-of-fit summary table.

Everything here is computed from the statistics the replicas exchange at sync points
(:class:`~lightning_aesgd.engine.plan_loop.ReplicaStats`) and the plan in force, so every rank could log it; Lightning's
loggers write rank zero's copy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from lightning_aesgd.core.apportion import ideal_shares, share_error
from lightning_aesgd.core.tuning import rates_text
from lightning_aesgd.engine.plan_loop import ReplicaStats


def replica_figures(stats: Sequence[ReplicaStats], sizes: Sequence[int]) -> list[dict[str, float]]:
    """What each replica reports, in rank order, as plain numbers.

    Per rank: ``speed`` (units per active second), ``batch``, ``share`` of the step batch, normalised merge
    ``weight``, ``wait_fraction`` (of wall time blocked on peers), ``step_seconds`` (active seconds per step,
    release of a sync point to arrival at the next, smoothed), ``active_seconds`` (the latest period's, as
    measured), ``busy_seconds`` (inside the optimizer step, waits for peers left out), ``loader_seconds`` and
    ``noise``.

    Args:
        stats: the statistics every replica reported at the latest sync point, in rank order.
        sizes: the batch sizes of the plan in force, in rank order.
    """
    total = sum(sizes) or 1
    total_weight = sum(s.merge_weight for s in stats) or 1.0
    return [
        {
            "speed": replica.speed,
            "batch": size,
            "share": size / total,
            "weight": replica.merge_weight / total_weight,
            "wait_fraction": replica.wait_fraction,
            "step_seconds": replica.step_seconds,
            "active_seconds": replica.active_seconds,
            "busy_seconds": replica.busy_seconds,
            "loader_seconds": replica.loader_seconds,
            "noise": replica.noise,
        }
        for replica, size in zip(stats, sizes, strict=True)
    ]


METRIC_NAMES = {"speed": "samples_per_sec", "batch": "batch_size", "weight": "merge_weight", "noise": "step_noise"}
"""The logged name of a :func:`replica_figures` entry, where it is not the entry's own."""


def replica_metrics(stats: Sequence[ReplicaStats], sizes: Sequence[int]) -> dict[str, float]:
    """Metrics named ``aesgd/replica_<r>/<what>`` plus plan-wide ones, for Lightning's loggers.

    Args:
        stats: the statistics every replica reported at the latest merge, in rank order.
        sizes: the batch sizes of the plan in force, in rank order.

    Returns:
        Each replica's :func:`replica_figures` (``speed`` as ``samples_per_sec``, ``batch`` as ``batch_size``,
        ``weight`` as ``merge_weight``, ``noise`` as ``step_noise``) and ``left_out`` (1 where the plan gives it no
        work); ``aesgd/share_error`` (the largest relative distance of a share from the speed-proportional target)
        and ``aesgd/step_time_balance`` once every replica taking part has a speed.
    """
    metrics: dict[str, float] = {}
    for rank, figures in enumerate(replica_figures(stats, sizes)):
        prefix = f"aesgd/replica_{rank}"
        metrics |= {f"{prefix}/{METRIC_NAMES.get(name, name)}": float(value) for name, value in figures.items()}
        metrics[f"{prefix}/left_out"] = float(figures["batch"] == 0)
    stats, sizes = taking_part(stats, sizes)
    speeds = [s.speed for s in stats]
    if all(speed > 0 for speed in speeds):
        metrics["aesgd/share_error"] = share_error(sizes, speeds)
        metrics["aesgd/step_time_balance"] = step_time_balance(stats)
    return metrics


def taking_part(stats: Sequence[ReplicaStats], sizes: Sequence[int]) -> tuple[list[ReplicaStats], list[int]]:
    """The statistics and sizes of the replicas the plan gives work (a left-out replica's speed is stale)."""
    kept = [(replica, size) for replica, size in zip(stats, sizes, strict=True) if size > 0]
    return [replica for replica, _ in kept], [size for _, size in kept]


def step_time_balance(stats: Sequence[ReplicaStats]) -> float:
    """The slowest replica's active time per step over the fastest's: 1.0 when all arrive at sync points together.

    Lockstep replicas wait for the slowest at every step, so this is what planning exists to bring to 1.
    """
    times = [s.step_seconds for s in stats]
    return max(times) / min(times) if min(times) > 0 else float("nan")


def summary_table(record: dict[str, Any]) -> str:
    """A plain-text table of a :func:`summary_record`: whether the plan converged and what it gained."""
    unit, sync_name = record["unit"], record["sync_name"]
    columns = ("replica", f"{unit}/s", "batch", "share", "target", "weight", "step ms", "busy ms", "waiting", "noise")
    widths = (7, 12, 6, 6, 6, 6, 8, 8, 7, 6)
    header = "  ".join(f"{name:>{width}}" for name, width in zip(columns, widths, strict=True))
    lines = ["adaptive_elastic: replicas at the end of fit", header, "-" * len(header)]
    for replica in record["replicas"]:
        target = replica["target"] if replica["target"] is not None else math.nan
        lines.append(
            f"{replica['rank']:>7}  {replica['speed']:>12.1f}  {replica['batch']:>6d}  {replica['share']:>6.3f}  "
            f"{target:>6.3f}  {replica['weight']:>6.3f}  {1000 * replica['step_seconds']:>8.1f}  "
            f"{1000 * replica['busy_seconds']:>8.1f}  {replica['wait_fraction']:>7.1%}  {replica['noise']:>6.1%}"
        )
    lines.append(f"{sync_name}: {record['syncs']}")
    learners = record.get("learners")
    if learners is not None:
        measured = rates_text(learners["measured"])
        lines.append(
            f"learners per replica: {learners['per_replica']}"
            + (f" (auto; the job's samples/s by learners per replica: {measured})" if measured else "")
        )
    if record["share_error"] is not None:
        lines.append(
            f"plan vs speed-proportional target: largest relative share error {record['share_error']:.1%}; "
            f"slowest/fastest step time: {record['step_time_balance']:.2f} (1.00: all arrive at {sync_name} "
            "together)"
        )
        lines += record["starved"]
    return "\n".join(lines)


def summary_record(
    stats: Sequence[ReplicaStats],
    sizes: Sequence[int],
    syncs: int,
    unit: str = "samples",
    floors: Sequence[int] = (),
    sync_name: str = "merges",
) -> dict[str, Any]:
    """The end-of-fit summary as plain data for JSON (``None`` where a figure is not measured).

    Args:
        stats: the statistics of the latest sync point, in rank order.
        sizes: the plan in force.
        syncs: number of sync points so far.
        unit: what speeds count: ``"samples"`` or cost ``"units"``.
        floors: each replica's smallest batch (none: 0); a replica held there and still late is named.
        sync_name: what the sync points are in the sync mode (``"merges"``, ``"gradient sums"``).

    Returns:
        ``unit``, ``sync_name`` and ``syncs`` (what the sync points are, and how many passed), ``replicas``
        (per rank: its ``rank``, :func:`replica_figures` and ``target``, the speed-proportional share),
        ``share_error`` and ``step_time_balance`` (``None`` until every replica has a speed) and ``starved`` (the
        warnings of :func:`starved_replicas`).
    """
    speeds = [s.speed for s in stats]
    measured = all(speed > 0 for speed in speeds)
    kept, kept_sizes = taking_part(stats, sizes)
    targets = ideal_shares(speeds) if measured else [math.nan] * len(stats)
    replicas = [
        {"rank": rank, **figures, "batch": int(figures["batch"]), "target": target}
        for rank, (figures, target) in enumerate(zip(replica_figures(stats, sizes), targets, strict=True))
    ]
    record: dict[str, Any] = {
        "unit": unit,
        "sync_name": sync_name,
        "syncs": syncs,
        "replicas": replicas,
        "share_error": share_error(kept_sizes, [s.speed for s in kept]) if measured else None,
        "step_time_balance": step_time_balance(kept) if measured else None,
        "starved": starved_replicas(stats, sizes, floors) if measured else [],
    }
    finite: dict[str, Any] = _finite(record)
    return finite


def _finite(value: Any) -> Any:
    """``value`` with every non-finite float replaced by ``None`` (JSON has no NaN)."""
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_finite(item) for item in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def starved_replicas(stats: Sequence[ReplicaStats], sizes: Sequence[int], floors: Sequence[int] = ()) -> list[str]:
    """A line for every replica left out of the steps, and for each one at the floor batch that is still late.

    Late means its steps take 10% longer than the others'. Such a device only slows the others down: training
    without it would be faster.
    """
    lines = []
    for rank, (replica, size) in enumerate(zip(stats, sizes, strict=True)):
        others = [s.step_seconds for r, s in enumerate(stats) if r != rank and s.step_seconds > 0 and sizes[r] > 0]
        if size == 0:
            lines.append(
                f"replica {rank} is left out of the steps: at its latest measurement its steps took "
                f"{1000 * replica.step_seconds:.1f} ms, longer than the others need for the whole step batch "
                f"({1000 * max(others, default=0.0):.1f} ms a step); it is probed now and then and let back in when "
                "it would help (leave_out_stragglers)."
            )
            continue
        if size > (floors[rank] if floors else 0) or not others or replica.step_seconds <= 1.1 * max(others):
            continue
        lines.append(
            f"replica {rank} sits at the smallest batch ({size}) and its steps still take "
            f"{replica.step_seconds / max(others):.1f}× the others': it holds every step up. HINT: train without "
            "this device, or lower the strategy's min_share."
        )
    return lines
