"""The built wheel works on its own: installed into a fresh environment, its commands run from any directory.

The slow test builds the wheel from a copy of the sources (the checkout stays clean), installs it without
dependencies into a new virtual environment that reuses the dependencies of the running one (nothing is
downloaded), and runs ``aesgd-train`` and ``aesgd-bench`` from a directory outside the checkout, with
``PYTHONPATH`` cleared, after checking that the package is imported from the environment and not the checkout.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

import pytest
from setuptools import find_packages

ROOT = Path(__file__).resolve().parent.parent
# What building the wheel reads; everything else in the checkout is left out of the copy.
BUILD_INPUTS = ("pyproject.toml", "README.md", "LICENSE", "lightning_aesgd", "configs")
# Launcher and configuration variables a surrounding run may have exported.
_CLEARED = ("PYTHONPATH", "AESGD_CONFIG_DIR", "LOCAL_RANK", "NODE_RANK", "GLOBAL_RANK", "WORLD_SIZE", "MASTER_ADDR")
# Entries of the running environment the new one must not see (names as they start, lower case).
_HIDDEN = (
    "lightning_aesgd",
    "__editable__.lightning_aesgd",
    "__editable___lightning_aesgd",
    "matplotlib",
    "mpl_toolkits",
    "pylab",
)
# Two replicas at full speed, a few steps of the default workload: seconds, not minutes.
TINY_DEVICES = "num_replicas: 2\nslowdown:\n  base: 1\n  factors: [1, 1]\n"
TINY_RUN = (
    "devices=tiny",
    "trainer.max_epochs=1",
    "+trainer.limit_train_batches=4",
    "+trainer.limit_val_batches=2",
    "+trainer.enable_progress_bar=false",
    "test=false",
)


def _declared_packages() -> list[str]:
    tomllib = pytest.importorskip("tomllib")
    with (ROOT / "pyproject.toml").open("rb") as handle:
        return tomllib.load(handle)["tool"]["setuptools"]["packages"]


def test_the_package_list_names_every_package_of_the_source_tree():
    found = find_packages(str(ROOT), include=["lightning_aesgd", "lightning_aesgd.*"])
    assert sorted(_declared_packages()) == sorted([*found, "lightning_aesgd.configs"])


def _run(command: list[str], cwd: Path, env: dict[str, str], timeout: float) -> str:
    start = time.perf_counter()
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    print(f"{time.perf_counter() - start:5.1f} s  {' '.join(command[:3])}")  # shown with -s or on failure
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{' '.join(command)} failed ({result.returncode}):\n{output[-4000:]}"
    return output


def _build_wheel(tmp_path: Path) -> Path:
    source = tmp_path / "source"
    source.mkdir()
    for name in BUILD_INPUTS:
        origin = ROOT / name
        if origin.is_dir():
            shutil.copytree(origin, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(origin, source / name)
    dist = tmp_path / "dist"
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index"]
    _run([*command, "--wheel-dir", str(dist), str(source)], cwd=tmp_path, env=dict(os.environ), timeout=120)
    (wheel,) = dist.glob("lightning_aesgd-*.whl")
    return wheel


def _environment(tmp_path: Path, wheel: Path) -> Path:
    """A new virtual environment with the wheel installed, reusing the running environment's other packages.

    The reused packages are seen through a directory of links placed after the environment's own site-packages:
    no .pth file of the running environment is processed (an editable install of this checkout among them),
    and every installed copy of this package is left out, as is matplotlib (a user without the ``bench`` extra).
    """
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp_path, {}, 120)
    python = venv / "bin" / "python"
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index"]
    _run([*install, "--disable-pip-version-check", str(wheel)], tmp_path, dict(os.environ), 120)
    reused = tmp_path / "reused"
    reused.mkdir()
    for directory in dict.fromkeys(
        [sysconfig.get_path("purelib"), sysconfig.get_path("platlib"), *site.getsitepackages()]
    ):
        for entry in Path(directory).iterdir() if Path(directory).is_dir() else ():
            hidden = entry.name.lower().startswith(_HIDDEN) or entry.suffix == ".pth"
            if not hidden and not (reused / entry.name).exists():
                (reused / entry.name).symlink_to(entry)
    purelib = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], tmp_path, {}, 60)
    (Path(purelib.strip()) / "_reused_packages.pth").write_text(f"{reused}\n")
    return venv


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_installed_wheel_runs_its_commands_outside_the_checkout(tmp_path):
    wheel = _build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    assert "lightning_aesgd/configs/train.yaml" in names
    assert "lightning_aesgd/configs/algorithm/adaptive_sgd.yaml" in names
    assert "lightning_aesgd/configs/hydra/launcher/submitit_local.yaml" in names  # nested groups too
    assert any(name.endswith(".dist-info/licenses/LICENSE") for name in names)

    venv = _environment(tmp_path, wheel)
    bin_dir = venv / "bin"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in _CLEARED} | {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"
    }

    # Where the package would be imported from, found without importing torch (seconds saved).
    probe = (
        "import importlib.util as u; print('spec', u.find_spec('matplotlib'), u.find_spec('lightning_aesgd').origin)"
    )
    output = _run([str(bin_dir / "python"), "-c", probe], elsewhere, env, 60)
    (found,) = [line.split() for line in output.splitlines() if line.startswith("spec ")]
    assert found[1] == "None"  # the environment lacks matplotlib
    imported = Path(found[2]).resolve()
    assert imported.is_relative_to(venv.resolve()), imported
    assert not imported.is_relative_to(ROOT)

    help_text = _run([str(bin_dir / "aesgd-train"), "--help"], elsewhere, env, 120)
    assert "algorithm: abs_sgd, adaptive_elastic, adaptive_sgd" in help_text

    # A config directory of the user's own adds an option to a built-in group.
    user_configs = tmp_path / "my_configs"
    (user_configs / "devices").mkdir(parents=True)
    (user_configs / "devices" / "tiny.yaml").write_text(TINY_DEVICES)
    run_dir = elsewhere / "run"
    command = [str(bin_dir / "aesgd-train"), "--config-dir", str(user_configs), *TINY_RUN, f"hydra.run.dir={run_dir}"]
    output = _run(command, elsewhere, env, 180)
    assert "results: " in output
    assert (run_dir / "logs" / "metrics.csv").exists()

    # Plotting is imported lazily: the benchmark's help works without matplotlib, which the environment lacks.
    bench_help = _run([str(bin_dir / "aesgd-bench"), "--help"], elsewhere, env, 120)
    assert "--profiles" in bench_help
