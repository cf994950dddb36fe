"""What the strategy reports: per-replica metrics for Lightning's loggers and an end-of-fit summary table.

Everything here is computed from the statistics the replicas exchange at merges
(:class:`~lightning_aesgd.routing.ReplicaStats`) and the plan in force, so every rank could log it; Lightning's
loggers write rank zero's copy.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_aesgd.core.planning import ideal_shares, share_error
from lightning_aesgd.routing import ReplicaStats


def replica_metrics(stats: Sequence[ReplicaStats], sizes: Sequence[int]) -> dict[str, float]:
    """Metrics named ``aesgd/replica_<r>/<what>`` plus plan-wide ones, for ``LightningModule.log_dict``.

    Args:
        stats: the statistics every replica reported at the latest merge, in rank order.
        sizes: the batch sizes of the plan in force, in rank order.

    Returns:
        samples (or cost units) per second, batch size, share of the step batch, normalised merge weight and
        fraction of wall time spent waiting, per replica; and ``aesgd/share_error`` (the largest relative
        distance of a share from the speed-proportional ideal) once every replica has a speed.
    """
    total = sum(sizes)
    total_weight = sum(s.merge_weight for s in stats) or 1.0
    metrics: dict[str, float] = {}
    for rank, (replica, size) in enumerate(zip(stats, sizes, strict=True)):
        prefix = f"aesgd/replica_{rank}"
        metrics[f"{prefix}/samples_per_sec"] = replica.speed
        metrics[f"{prefix}/batch_size"] = float(size)
        metrics[f"{prefix}/share"] = size / total
        metrics[f"{prefix}/merge_weight"] = replica.merge_weight / total_weight
        metrics[f"{prefix}/wait_fraction"] = replica.wait_fraction
    speeds = [s.speed for s in stats]
    if all(speed > 0 for speed in speeds):
        metrics["aesgd/share_error"] = share_error(sizes, speeds)
    return metrics


def routing_gain(sizes: Sequence[int], speeds: Sequence[float]) -> float:
    """How much faster a step runs with this plan than with an equal split, at the measured speeds.

    A step lasts as long as its slowest replica: ``max_i b_i / v_i``. The gain is that time for equal batches
    ``M/n`` divided by that time for the plan.
    """
    equal = sum(sizes) / len(sizes)
    planned_time = max(size / speed for size, speed in zip(sizes, speeds, strict=True))
    equal_time = max(equal / speed for speed in speeds)
    return equal_time / planned_time


def summary_table(stats: Sequence[ReplicaStats], sizes: Sequence[int], merges: int, unit: str = "samples") -> str:
    """A plain-text table that shows whether the plan converged and what it gained.

    Args:
        stats: the statistics of the latest merge, in rank order.
        sizes: the plan in force.
        merges: number of merges so far.
        unit: what speeds count: ``"samples"`` or cost ``"units"``.
    """
    speeds = [s.speed for s in stats]
    measured = all(speed > 0 for speed in speeds)
    ideal = ideal_shares(speeds) if measured else [float("nan")] * len(stats)
    total, total_weight = sum(sizes), sum(s.merge_weight for s in stats) or 1.0
    header = (
        f"{'replica':>7}  {unit + '/s':>12}  {'batch':>6}  {'share':>6}  {'ideal':>6}  {'weight':>6}  {'waiting':>7}"
    )
    lines = ["adaptive_elastic: replicas at the end of fit", header, "-" * len(header)]
    for rank, (replica, size, target) in enumerate(zip(stats, sizes, ideal, strict=True)):
        lines.append(
            f"{rank:>7}  {replica.speed:>12.1f}  {size:>6d}  {size / total:>6.3f}  {target:>6.3f}  "
            f"{replica.merge_weight / total_weight:>6.3f}  {replica.wait_fraction:>7.1%}"
        )
    lines.append(f"merges: {merges}")
    if measured:
        lines.append(
            f"plan vs speed-proportional ideal: largest relative share error {share_error(sizes, speeds):.1%}; "
            f"estimated step time {routing_gain(sizes, speeds):.2f}x shorter than with equal batches"
        )
    return "\n".join(lines)
