import os
import time

import pytest

from lightning_aesgd.emulation.cpu_quota import CpuQuota, quota_unavailable


def test_a_cpu_quota_without_cgroups_fails_with_the_fix(tmp_path):
    assert "no cgroup cpu controller" in quota_unavailable(tmp_path)
    with pytest.raises(RuntimeError, match="HINT"):
        CpuQuota(0.5, "test", root=tmp_path).apply()


@pytest.mark.skipif(quota_unavailable() is not None, reason="CPU quotas need writable cgroups")
def test_a_real_cpu_quota_throttles_this_process_and_is_released():
    def wall_seconds_for(cpu_seconds):
        started, cpu = time.perf_counter(), time.process_time()
        while time.process_time() - cpu < cpu_seconds:
            pass
        return time.perf_counter() - started

    quota = CpuQuota(0.25, f"lightning_aesgd_test_{os.getpid()}")
    quota.apply()
    try:
        throttled = wall_seconds_for(0.1)
    finally:
        quota.release()
    assert throttled > 2.5 * 0.1  # a quarter of a core: about 4× the CPU time in wall time
    assert not quota.group.exists()
