"""The main job as a user runs it: what its console shows, and what reaches the user's tools afterwards."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig

from lightning_aesgd.console import KnownNoiseFilter
from lightning_aesgd.strategy import SUMMARY_FILE
from lightning_aesgd.train import FirstValidation, config_dir, hyperparameters

SUMMARY = "adaptive_elastic: replicas at the end of fit"
LINE_BUDGET = 10
"""Lines the main job may print besides the progress bar, the end-of-fit summary and the results."""
_LAUNCH_VARIABLES = ("LOCAL_RANK", "NODE_RANK", "GLOBAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_PROGRESS = re.compile(r"^\s*(\x1b\[A)?\s*$|(it/s|s/it)\]|^(Training|Validation|Testing|Epoch \d+)\b.*\|")


def other_lines(output: str) -> list[str]:
    """The lines of ``output`` outside the progress bar, the end-of-fit summary and the results line.

    The progress bar rewrites its line with carriage returns; the summary runs from its title to its last line
    (``merges:``, the balance and any starved replica's hint).
    """
    lines, in_summary = [], False
    for line in re.split(r"[\r\n]", output):
        if SUMMARY in line:
            in_summary = True
            continue
        if in_summary and re.match(r"^(\s*\d+\s|replica|-+$|merges:|gradient sums:|plan vs|replica \d+ sits)", line):
            continue
        in_summary = False
        if _PROGRESS.search(line) or "results: " in line:
            continue
        lines.append(line)
    return lines


def _run_job(overrides: list[str], tmp_path: Path, timeout: float = 240) -> str:
    """Run the main job with ``overrides`` in a fresh session of processes; its output, once it succeeded."""
    command = [sys.executable, "-m", "lightning_aesgd.train", *overrides, f"hydra.run.dir={tmp_path}"]
    environment = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARIABLES}
    with subprocess.Popen(
        command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    ) as process:
        try:
            output, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
            pytest.fail(f"the main job ran over {timeout} s; its output ends with:\n{output[-4000:]}")
    assert process.returncode == 0, output[-4000:]
    return output


@pytest.mark.slow
@pytest.mark.distributed
def test_the_main_job_prints_one_line_per_fact_and_leaves_its_figures_to_the_users_tools(tmp_path):
    # The default experiment (4 replicas under the strong profile, forked), one epoch of 7 steps, then test.
    output = _run_job(["trainer.max_epochs=1"], tmp_path)
    others = other_lines(output)
    assert len(others) <= LINE_BUDGET, "\n".join(others)
    assert len(set(others)) == len(others), "\n".join(others)  # one line per fact
    for noise in ("LeafSpec", "Sparse invariant", "Tip:", "Initializing distributed"):
        assert noise not in output, output[-4000:]
    assert SUMMARY in output
    assert re.search(r"results: .*first_val/p@1=0\.\d+.*test/p@1=0\.\d+", output)

    train_log = (tmp_path / "train.log").read_text()
    assert SUMMARY in train_log
    assert "results: " in train_log
    summary = json.loads((tmp_path / "logs" / SUMMARY_FILE).read_text())
    assert len(summary["replicas"]) == 4
    assert (summary["syncs"], summary["sync_name"]) == (7, "merges")  # warm-up merges after every step
    params = yaml.safe_load((tmp_path / "logs" / "hparams.yaml").read_text())
    assert params["algorithm"]["name"] == "adaptive_sgd"
    assert params["algorithm"]["planner"] == "balanced"
    assert params["devices"]["name"] == "strong"
    assert params["devices"]["slowdown"]["factors"] == [1, 1, 2, 4]
    assert params["hidden"] == 128  # the model's own hyperparameters stay beside them


@pytest.mark.slow
@pytest.mark.distributed
def test_replicas_launched_by_popen_test_once_on_rank_zero(tmp_path):
    # Every rank runs the script under popen (and torchrun): the test must not run on each, nor gather over the fit's
    # process group, which with several GPUs would put every rank's metrics on the first GPU.
    overrides = ["launch.start_method=popen", "devices=real", "trainer.devices=2", "trainer.max_epochs=1"]
    overrides.append("optimized_metric=test/p@1")  # only rank zero has it: the others return no value of theirs
    output = _run_job(overrides, tmp_path, timeout=180)
    results = [line for line in output.splitlines() if "results: " in line]
    assert len(results) == 1, output[-4000:]
    assert re.search(r"test/p@1=0\.\d+", results[0])
    assert "sync_dist=True" not in output  # Lightning's warning where a test's metrics meet a process group
    assert "is not among the job's metrics" not in output, output[-4000:]


def test_other_lines_leaves_out_the_bar_the_summary_and_the_results():
    output = (
        "Seed set to 0\n"
        "Epoch 0:  14%|█▍        | 1/7 [00:00<00:05,  1.09it/s]\rEpoch 0: 100%|██████████| 7/7 [00:03<00:00]\n"
        "Validation DataLoader 0: 100%|██████████| 1/1 [00:00<00:00, 13.20it/s]\x1b[A\n"
        f"[t][lightning_aesgd.strategy][INFO] - {SUMMARY}\n"
        "replica       units/s   batch\n-----\n      0      243484.9     699\nmerges: 23\nplan vs target: 5.4%\n"
        "[t][__main__][INFO] - results: test/p@1=0.9\n"
        "`Trainer.fit` stopped: `max_epochs=1` reached.\n"
    )
    assert other_lines(output) == ["Seed set to 0", "`Trainer.fit` stopped: `max_epochs=1` reached."]


def _record(message: str) -> logging.LogRecord:
    return logging.LogRecord("lightning_fabric.utilities.rank_zero", logging.INFO, __file__, 1, message, None, None)


def test_the_noise_filter_drops_tips_and_per_rank_lines_and_shows_device_lines_once():
    noise = KnownNoiseFilter()
    assert not noise.filter(_record("💡 Tip: For seamless cloud uploads and versioning, try installing litmodels"))
    assert not noise.filter(_record("Initializing distributed: GLOBAL_RANK: 2, MEMBER: 3/4"))
    assert noise.filter(_record("GPU available: False, used: False"))
    assert not noise.filter(_record("GPU available: False, used: False"))
    assert noise.filter(_record("`Trainer.fit` stopped: `max_epochs=5` reached."))
    assert noise.filter(_record("`Trainer.fit` stopped: `max_epochs=5` reached."))  # only device lines are kept once
    banner = _record(
        f"{'-' * 100}\ndistributed_backend=gloo\nAll distributed processes registered. Starting with 4 processes\n"
        f"{'-' * 100}\n"
    )
    assert noise.filter(banner)
    registered = "All distributed processes registered. Starting with 4 processes; distributed_backend=gloo"
    assert banner.getMessage() == registered


def test_the_first_validation_is_kept_in_the_callback_metrics_whatever_the_logger():
    metrics = {"val/p@1": torch.tensor(0.5), "train/loss": torch.tensor(2.0)}
    trainer = SimpleNamespace(callback_metrics=metrics, sanity_checking=True)
    callback = FirstValidation()
    callback.on_validation_end(trainer, None)  # type: ignore[arg-type]
    assert "first_val/p@1" not in metrics  # a sanity check is not the first validation
    trainer.sanity_checking = False
    callback.on_validation_end(trainer, None)  # type: ignore[arg-type]
    metrics["val/p@1"] = torch.tensor(0.9)
    callback.on_validation_end(trainer, None)  # type: ignore[arg-type]
    assert float(metrics["first_val/p@1"]) == 0.5
    assert "first_train/loss" not in metrics


@pytest.mark.parametrize(("algorithm", "devices"), [("adaptive_sgd", "strong"), ("ddp", "mild")])
def test_the_hyperparameters_name_the_algorithm_its_options_and_the_devices(tmp_path, algorithm, devices):
    with initialize_config_dir(config_dir=str(Path(config_dir())), version_base="1.3"):
        cfg = compose(
            "train",
            overrides=[f"hydra.runtime.output_dir={tmp_path}", f"algorithm={algorithm}", f"devices={devices}"],
            return_hydra_config=True,
        )
    HydraConfig.instance().set_config(cfg)
    params = hyperparameters(cfg)
    assert params["algorithm"]["name"] == algorithm
    assert params["algorithm"]["start_method"] == "fork"  # interpolations are resolved
    assert params["devices"]["name"] == devices
    assert params["devices"]["num_replicas"] == cfg.devices.num_replicas
    if algorithm == "adaptive_sgd":
        assert params["algorithm"]["class"] == "lightning_aesgd.AdaptiveElasticStrategy"
        assert params["algorithm"]["merge_rule"]["momentum"] == 0.3
    json.dumps(params)  # plain data, as every logger takes it
