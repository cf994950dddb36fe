"""Run a test body in a fresh Python process that sees the GPUs this test process hides (see conftest.py).

A ``cuda`` test calls ``run_on_cuda("module:function", *args)``: the function (importable from the tests
folder, arguments that ``repr`` round-trips) runs in a new interpreter with the original ``CUDA_VISIBLE_DEVICES``,
and an exception there fails the test with the child's output.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def run_on_cuda(target: str, *args: object, timeout: float = 600.0) -> str:
    """Call ``target`` (``"module:function"``) with ``args`` in a process that sees the GPUs; return its output."""
    module, function = target.split(":")
    env = dict(os.environ)
    env["CUDA_VISIBLE_DEVICES"] = os.environ.get("AESGD_TEST_CUDA_VISIBLE_DEVICES", "")
    if not env["CUDA_VISIBLE_DEVICES"]:
        del env["CUDA_VISIBLE_DEVICES"]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH", "")]))
    code = f"import {module}; {module}.{function}(*{args!r})"
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    output = result.stdout + result.stderr
    if result.returncode != 0:
        raise AssertionError(f"{target}{args!r} failed on CUDA (exit {result.returncode}):\n{output[-6000:]}")
    return output
