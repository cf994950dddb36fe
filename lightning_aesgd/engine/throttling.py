"""Time this process spent frozen by its CPU quota (Linux control groups), from its cgroup's ``cpu.stat``.

A replica over its quota is frozen until the quota period ends, wherever it is: often inside a collective, where
the arrival clock counts the time as waiting for peers although the peers were waiting for it. The frozen time
of a wait is the replica's own (:class:`~lightning_aesgd.engine.arrivals.ArrivalClock` counts it as active).
"""

from __future__ import annotations

import time
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
RESOLVE_SECONDS = 1.0
"""How long the cgroup found for this process is trusted before it is looked up again (a process may move)."""


def cpu_stat_path(proc_cgroup: str, root: Path = CGROUP_ROOT) -> Path | None:
    """The ``cpu.stat`` of the cpu-controller group in ``/proc/self/cgroup``'s text, or ``None``."""
    for line in proc_cgroup.splitlines():
        hierarchy, controllers, path = [*line.split(":", 2), "", ""][:3]
        relative = path.lstrip("/")
        if "cpu" in controllers.split(","):  # cgroup v1
            return root / "cpu" / relative / "cpu.stat"
        if hierarchy == "0" and controllers == "" and (root / "cgroup.controllers").is_file():  # cgroup v2
            return root / relative / "cpu.stat"
    return None


def throttled_seconds(cpu_stat: str) -> float:
    """Seconds of throttling a ``cpu.stat`` text counts (``throttled_usec`` on v2, ``throttled_time`` ns on v1)."""
    for line in cpu_stat.splitlines():
        name, _, value = line.partition(" ")
        if name == "throttled_usec":
            return int(value) / 1e6
        if name == "throttled_time":
            return int(value) / 1e9
    return 0.0


class ThrottleMeter:
    """This process's cumulative throttled seconds; 0 where no cgroup or quota can be read (never raises).

    Reading costs a small file read; where the group has no quota the file is not read at all.
    """

    def __init__(self, root: Path = CGROUP_ROOT) -> None:
        self.root = root
        self._path: Path | None = None
        self._resolved_at = -float("inf")

    def __call__(self) -> float:
        """Seconds this process's group has been throttled so far (0 without a quota)."""
        path = self._cpu_stat()
        if path is None:
            return 0.0
        try:
            return throttled_seconds(path.read_text())
        except (OSError, ValueError):
            return 0.0

    def _cpu_stat(self) -> Path | None:
        now = time.monotonic()
        if now - self._resolved_at >= RESOLVE_SECONDS:
            self._resolved_at = now
            self._path = self._quota_group_stat()
        return self._path

    def _quota_group_stat(self) -> Path | None:
        """The ``cpu.stat`` of this process's group where the group has a CPU quota."""
        try:
            path = cpu_stat_path(Path("/proc/self/cgroup").read_text(), self.root)
            if path is None:
                return None
            quota_v1, limit_v2 = path.parent / "cpu.cfs_quota_us", path.parent / "cpu.max"
            if quota_v1.is_file() and int(quota_v1.read_text()) > 0:
                return path
            if limit_v2.is_file() and not limit_v2.read_text().startswith("max"):
                return path
        except (OSError, ValueError):
            pass
        return None
