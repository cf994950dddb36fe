"""Real CPU quotas for one process, through Linux control groups (the ``quota`` slowdown mode).

A container's CPU limit, or a job share on a crowded node, throttles a process wherever it happens to be: in
data loading, in hooks, inside a collective. :class:`CpuQuota` puts the calling process (and every process it
starts afterwards, such as DataLoader workers) into a control group of its own limited to ``cores`` CPUs:

* cgroup v1: ``<root>/cpu/<name>/cpu.cfs_quota_us`` = ``cores × cpu.cfs_period_us``;
* cgroup v2: ``<root>/<name>/cpu.max`` = ``"<cores × period> <period>"``.

It needs write access to the hierarchy (root, or a delegated subtree); :func:`quota_unavailable` says why not
where it cannot work. The process moves back and the group is removed by :meth:`CpuQuota.release`.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PERIOD_US = 20_000  # short periods spread throttling evenly over a step instead of one long stall


def _v1_root(root: Path) -> Path:
    return root / "cpu"


def _is_v2(root: Path) -> bool:
    return (root / "cgroup.controllers").is_file()


def quota_unavailable(root: Path = CGROUP_ROOT) -> str | None:
    """Why CPU quotas cannot be set here, or ``None`` when they can."""
    if _is_v2(root):
        if "cpu" not in (root / "cgroup.subtree_control").read_text().split():
            return f"cgroup v2 at {root} does not delegate the cpu controller to child groups"
        base = root
    elif (_v1_root(root) / "cpu.cfs_quota_us").is_file():
        base = _v1_root(root)
    else:
        return f"no cgroup cpu controller is mounted at {root}"
    if not os.access(base, os.W_OK):
        return f"{base} is not writable by this user (CPU quotas need root or a delegated cgroup)"
    return None


class CpuQuota:
    """Limit this process, and those it starts later, to ``cores`` CPUs.

    Args:
        cores: CPUs' worth of time per period (0.5: half of one core).
        name: the control group's name, unique per process.
        root: where the cgroup hierarchy is mounted.
        period_us: the scheduler period in microseconds.
    """

    def __init__(self, cores: float, name: str, root: Path = CGROUP_ROOT, period_us: int = PERIOD_US) -> None:
        if not cores > 0:
            raise ValueError(f"A CPU quota needs cores > 0, got {cores}.")
        self.cores = cores
        self.root = root
        self.period_us = period_us
        self.v2 = _is_v2(root)
        self.group = (root if self.v2 else _v1_root(root)) / name
        self._previous: Path | None = None

    def apply(self) -> None:
        """Create the group, set the quota and move this process into it.

        Raises:
            RuntimeError: where quotas cannot be set; the message says why.
        """
        reason = quota_unavailable(self.root)
        if reason is not None:
            raise RuntimeError(
                f"The 'quota' slowdown mode needs writable CPU control groups: {reason}. HINT: run as root on "
                "Linux with the cgroup cpu controller, or use the 'user', 'data' or 'hook' mode."
            )
        quota_us = max(1000, round(self.cores * self.period_us))
        previous = self._current_group()
        self.group.mkdir(exist_ok=True)
        try:
            if self.v2:
                (self.group / "cpu.max").write_text(f"{quota_us} {self.period_us}")
            else:
                (self.group / "cpu.cfs_period_us").write_text(str(self.period_us))
                (self.group / "cpu.cfs_quota_us").write_text(str(quota_us))
            (self.group / "cgroup.procs").write_text(str(os.getpid()))
        except OSError:
            with contextlib.suppress(OSError):
                self.group.rmdir()
            raise
        self._previous = previous

    def _current_group(self) -> Path:
        """The cgroup this process is in now (the cpu controller's, on cgroup v1), to move back to."""
        base = self.group.parent
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if (self.v2 and controllers == "") or (not self.v2 and "cpu" in controllers.split(",")):
                candidate = base / path.lstrip("/")
                if (candidate / "cgroup.procs").is_file():
                    return candidate
        return base

    def release(self) -> None:
        """Move this process back to the parent group and remove the quota's group."""
        if self._previous is None:
            return
        with contextlib.suppress(OSError):
            (self._previous / "cgroup.procs").write_text(str(os.getpid()))
        with contextlib.suppress(OSError):  # still busy while a child (a loader worker) lives on
            self.group.rmdir()
        self._previous = None
