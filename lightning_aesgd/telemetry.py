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
        fraction of wall time spent waiting and busy seconds per step, per replica; ``aesgd/share_error`` (the
        largest relative distance of a share from the speed-proportional target) once every replica has a
        speed; and ``aesgd/step_time_balance``.
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
        metrics[f"{prefix}/step_seconds"] = replica.step_seconds
    speeds = [s.speed for s in stats]
    if all(speed > 0 for speed in speeds):
        metrics["aesgd/share_error"] = share_error(sizes, speeds)
        metrics["aesgd/step_time_balance"] = step_time_balance(stats)
    return metrics


def step_time_balance(stats: Sequence[ReplicaStats]) -> float:
    """The slowest replica's busy time per step over the fastest's: 1.0 when all finish their step together.

    Lockstep replicas wait for the slowest at every step, so this is what routing exists to bring to 1.
    """
    times = [s.step_seconds for s in stats]
    return max(times) / min(times) if min(times) > 0 else float("nan")


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
    targets = ideal_shares(speeds) if measured else [float("nan")] * len(stats)
    total, total_weight = sum(sizes), sum(s.merge_weight for s in stats) or 1.0
    columns = ("replica", f"{unit}/s", "batch", "share", "target", "weight", "step ms", "waiting")
    widths = (7, 12, 6, 6, 6, 6, 8, 7)
    header = "  ".join(f"{name:>{width}}" for name, width in zip(columns, widths, strict=True))
    lines = ["adaptive_elastic: replicas at the end of fit", header, "-" * len(header)]
    for rank, (replica, size, target) in enumerate(zip(stats, sizes, targets, strict=True)):
        lines.append(
            f"{rank:>7}  {replica.speed:>12.1f}  {size:>6d}  {size / total:>6.3f}  {target:>6.3f}  "
            f"{replica.merge_weight / total_weight:>6.3f}  {1000 * replica.step_seconds:>8.1f}  "
            f"{replica.wait_fraction:>7.1%}"
        )
    lines.append(f"merges: {merges}")
    if measured:
        lines.append(
            f"plan vs speed-proportional target: largest relative share error {share_error(sizes, speeds):.1%}; "
            f"slowest/fastest busy time per step: {step_time_balance(stats):.2f} (1.00: all finish together)"
        )
    return "\n".join(lines)
