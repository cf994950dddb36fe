"""Several learners per device (Crossbow) through the Trainer: parity with one learner per process, every sample
once, resume, evaluation of the merged model, and the settings it refuses before training."""

from __future__ import annotations

import json
import logging
import os
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import pytorch_lightning as pl
import torch
from helpers import RegressionData, RegressionModel, cpu_trainer, flat_parameters
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_aesgd import SMA, AdaptiveElasticStrategy
from lightning_aesgd.checks import UnsupportedSettingError
from lightning_aesgd.engine import learner_tuning
from lightning_aesgd.engine.learners import LearnerStepError

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(240)]

TIMEOUT = timedelta(seconds=90)


class LearnerModel(RegressionModel):
    """The regression model with a step that runs batched: it records indices outside the training step."""

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train/loss", loss)
        return loss

    def on_train_batch_start(self, batch, batch_idx):
        self.seen.append(batch[2].tolist() if isinstance(batch, list | tuple) else [])


def _strategy(learners: int, start_method: str = "fork", **options) -> AdaptiveElasticStrategy:
    """Crossbow's SMA unless ``options`` say otherwise; ``popen`` runs a one-process fit in the test process."""
    crossbow = {"planner": "static", "period": 1, "merge_rule": SMA(), "merge_weights": "uniform"}
    crossbow.update(options)
    return AdaptiveElasticStrategy(
        sync="models", learners_per_device=learners, start_method=start_method, timeout=TIMEOUT, **crossbow
    )


def _fit(strategy, devices: int, model=None, **trainer_kwargs) -> Tensor:
    pl.seed_everything(7)
    model = model or LearnerModel(momentum=0.9)
    cpu_trainer(strategy, devices=devices, **trainer_kwargs).fit(model)
    return flat_parameters(model)


def test_two_learners_in_one_process_train_as_two_processes_of_sma():
    """The same seed and split: learner j of the one process takes the rows process j takes (SMA, momentum).

    The one process is this test's own (popen): a forked replica with several threads, after this process ran
    threaded kernels, could wait forever on its inherited thread pool.
    """
    environment = dict(os.environ)
    two_processes = _fit(_strategy(1), devices=2, max_steps=20)
    os.environ.clear()  # what the launcher exported stays out of the next fit
    os.environ.update(environment)
    one_process = _fit(_strategy(2, start_method="popen"), devices=1, max_steps=20)
    initial = (pl.seed_everything(7), flat_parameters(LearnerModel()))[1]
    assert not torch.allclose(one_process, initial, atol=1e-3), "training must have moved the parameters"
    assert one_process.shape == initial.shape, "the module leaves fit holding one model"
    torch.testing.assert_close(one_process, two_processes, atol=1e-6, rtol=0)


class _AlternatingPlan:
    """A planner whose plans are no multiples of the learners: each is rounded, to (6, 2) or (2, 6) in turn."""

    def plan(self, current, speeds, total):
        return [1, 7] if tuple(current) == (6, 2) else [7, 1]


class _SeenWriter(pl.Callback):
    def __init__(self, directory):
        self.directory = directory

    def on_train_end(self, trainer, pl_module):
        (self.directory / f"seen_{trainer.global_rank}.json").write_text(json.dumps(pl_module.seen))


def test_every_sample_is_used_once_per_epoch_with_learners_and_changing_plans(tmp_path):
    """2 replicas × 2 learners, plans rounded to multiples of 2, and an epoch's short last step of 5 samples."""
    strategy = _strategy(2, planner=_AlternatingPlan(), merge_rule="elastic_average", merge_weights="samples")
    model = LearnerModel(size=69, batch_size=2)
    _fit(strategy, devices=2, model=model, max_epochs=2, callbacks=[_SeenWriter(tmp_path)])
    seen = [json.loads((tmp_path / f"seen_{rank}.json").read_text()) for rank in range(2)]
    steps_per_epoch = 9  # 8 steps of 8 samples, and one of 5
    assert [len(batches) for batches in seen] == [2 * steps_per_epoch] * 2
    sizes = [(len(seen[0][step]), len(seen[1][step])) for step in range(2 * steps_per_epoch)]
    for epoch in range(2):
        steps = range(epoch * steps_per_epoch, (epoch + 1) * steps_per_epoch)
        indices = [i for rank in range(2) for step in steps for i in seen[rank][step]]
        assert sorted(indices) == list(range(69)), f"epoch {epoch}: some index lost or seen twice"
        full, last = [sizes[step] for step in steps[:-1]], sizes[steps[-1]]
        assert all(size % 2 == 0 for pair in full for size in pair), "a full step's batches are whole learners'"
        assert sum(last) == 5, "the short step holds what is left of the epoch"
        assert min(last) >= 2, "the short step still gives each learner a sample"
    assert {(6, 2), (2, 6)} <= set(sizes), "the planner's plans, rounded to whole learners, must have been applied"


class BatchNormModel(LearnerModel):
    """BatchNorm and dropout: each learner keeps its statistics and draws its own masks."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, 1))


class _Shapes(pl.Callback):
    """Writes, per rank, the parameter shapes each validation saw (the replicas run in forked processes)."""

    def __init__(self, directory) -> None:
        self.directory = directory
        self.validated: list[list[list[int]]] = []

    def on_validation_epoch_start(self, trainer, pl_module):
        self.validated.append([list(p.shape) for p in pl_module.parameters()])

    def on_train_end(self, trainer, pl_module):
        (self.directory / f"shapes_{trainer.global_rank}.json").write_text(json.dumps(self.validated))


def test_learners_with_batch_norm_log_validate_and_save_the_merged_model(tmp_path):
    shapes = _Shapes(tmp_path)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    model = BatchNormModel()
    pl.seed_everything(7)
    trainer = cpu_trainer(
        _strategy(2, planner="proportional", merge_rule="elastic_average", period=2),
        max_epochs=2,
        limit_val_batches=None,
        callbacks=[shapes, checkpoint],
        enable_checkpointing=True,
        log_every_n_steps=1,
    )
    trainer.fit(model)
    plain = [list(p.shape) for p in BatchNormModel().parameters()]
    for rank in range(2):
        validated = json.loads((tmp_path / f"shapes_{rank}.json").read_text())
        assert len(validated) == 2
        assert all(seen == plain for seen in validated), "validation sees one model"
    assert [list(p.shape) for p in model.parameters()] == plain
    assert torch.isfinite(trainer.callback_metrics["train/loss"])
    loaded = BatchNormModel.load_from_checkpoint(tmp_path / "last.ckpt")  # a plain module takes the merged model
    torch.testing.assert_close(flat_parameters(loaded), flat_parameters(model))


def test_a_resumed_fit_with_learners_reaches_the_uninterrupted_parameters(tmp_path):
    def strategy():
        # Uneven plans, fixed: measured ones would make each fit's updates follow its own timing.
        return _strategy(2, planner="static", shares=[3, 1], merge_rule="elastic_average", period=3)

    steps = 20
    uninterrupted = _fit(strategy(), devices=2, max_steps=steps)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=9, save_top_k=-1, filename="{step}")
    _fit(strategy(), devices=2, max_steps=9, callbacks=[checkpoint], enable_checkpointing=True)
    pl.seed_everything(7)
    model = LearnerModel(momentum=0.9)
    cpu_trainer(strategy(), max_steps=steps).fit(model, ckpt_path=str(tmp_path / "step=9.ckpt"))
    torch.testing.assert_close(flat_parameters(model), uninterrupted, atol=1e-6, rtol=0)


class _ReadsTheLoss(LearnerModel):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("loss_value", loss.item())  # a host read: no batched step can do it
        return loss


class _SparseModel(LearnerModel):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(4, 2, sparse=True)


class _LineSearchModel(LearnerModel):
    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters())


@pytest.mark.parametrize(
    ("model", "trainer_kwargs", "error", "match"),
    [
        (_ReadsTheLoss, {}, LearnerStepError, r"\.item\(\)"),
        (_SparseModel, {}, UnsupportedSettingError, "sparse=False"),
        (LearnerModel, {"gradient_clip_val": 1.0}, UnsupportedSettingError, "gradient_clip_algorithm='value'"),
        (_LineSearchModel, {}, UnsupportedSettingError, "elementwise optimizer"),
    ],
    ids=["host-read", "sparse", "clip-norm", "line-search"],
)
def test_what_a_batched_step_cannot_do_fails_at_once_with_a_hint(model, trainer_kwargs, error, match):
    pl.seed_everything(7)
    module = model()
    before = flat_parameters(module)
    with pytest.raises(error, match=match) as raised:
        cpu_trainer(_strategy(2, start_method="popen"), devices=1, max_steps=3, **trainer_kwargs).fit(module)
    assert "HINT" in str(raised.value)
    assert [tuple(p.shape) for p in module.parameters()] == [tuple(p.shape) for p in model().parameters()]
    torch.testing.assert_close(flat_parameters(module), before, atol=0, rtol=0)
    # The error kept (as here) holds no graph of the learners: the module trains as one model again.
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    nn.functional.mse_loss(module(x), y).backward()


class _FixedCostModel(LearnerModel):
    """A training step with a fixed cost per call, whatever its rows: a batched call of k learners costs as one
    learner's, so k learners run k times the samples per second (the answer the tuner must find). The cost dwarfs
    the step's own compute even where that is slowed tenfold (an oversubscribed many-core machine made a batched
    step of two learners 40 ms slower than one's). ``spent`` adds the fixed costs up: a clock that counts nothing
    else, for a test whose answer must not depend on the machine's load."""

    spent = 0.0

    def training_step(self, batch, batch_idx):
        type(self).spent += 0.2
        time.sleep(0.2)
        return super().training_step(batch, batch_idx)


def _auto_strategy(**options) -> AdaptiveElasticStrategy:
    return _strategy("auto", start_method="popen", max_learners=2, **options)


def test_auto_keeps_the_second_learner_where_it_doubles_the_throughput(caplog, monkeypatch):
    monkeypatch.setattr(learner_tuning, "time", SimpleNamespace(perf_counter=lambda: _FixedCostModel.spent))
    strategy = _auto_strategy()
    with caplog.at_level(logging.INFO, logger="lightning_aesgd"):
        _fit(strategy, devices=1, model=_FixedCostModel(), max_steps=4)
    engine = strategy.engine
    assert len(engine.learner_rates) == 2
    assert engine.learner_rates[1] == pytest.approx(2 * engine.learner_rates[0])  # on a clock of fixed costs only
    assert engine.learners == 2
    assert strategy.plans.plan_book.latest == (8,), "each step holds a loader batch per learner"
    assert "learners_per_device='auto': samples/s by learners per replica {1: " in caplog.text
    assert "learners per replica: 2 (auto; the job's samples/s by learners per replica: 1: " in caplog.text


def test_auto_keeps_one_learner_where_the_second_brings_less_than_the_gain_asked():
    strategy = _auto_strategy(learner_min_gain=3.0)  # a second learner can at most double a fixed cost's rate
    _fit(strategy, devices=1, model=_FixedCostModel(), max_steps=4)
    assert len(strategy.engine.learner_rates) == 2
    assert strategy.engine.learners == 1
    assert strategy.plans.plan_book.latest == (4,)


def test_a_resumed_auto_fit_keeps_the_learners_of_its_checkpoint_without_measuring(tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, filename="{step}")
    _fit(_auto_strategy(), 1, _FixedCostModel(), max_steps=3, callbacks=[checkpoint], enable_checkpointing=True)
    resumed = _auto_strategy()
    pl.seed_everything(7)
    model = _FixedCostModel()
    cpu_trainer(resumed, devices=1, max_steps=6).fit(model, ckpt_path=str(tmp_path / "step=3.ckpt"))
    assert resumed.engine.learners == 2
    assert resumed.engine.learner_rates == [], "the checkpoint's choice is kept, not measured again"


class _InputRecorder(LearnerModel):
    """Records the batches its training step sees, which its batch-transfer hook turns into a dict first."""

    def __init__(self) -> None:
        super().__init__()
        self.inputs: list[dict[str, Tensor]] = []

    def on_before_batch_transfer(self, batch, dataloader_idx):
        x, y, index = batch
        return {"x": x, "y": y, "index": index}

    def training_step(self, batch, batch_idx):
        self.inputs.append(batch)
        return nn.functional.mse_loss(self(batch["x"]), batch["y"])

    def on_train_batch_start(self, batch, batch_idx):
        pass


def test_auto_times_the_step_on_the_batch_as_training_hands_it_over():
    """Lightning's loop converts a batch for the precision and runs the batch-transfer hooks before the step: the
    tuner's batch once skipped both (a `64-true` model met float32 inputs, and the step failed before the fit)."""
    model = _InputRecorder()
    strategy = _auto_strategy()
    _fit(strategy, devices=1, model=model, max_steps=2, precision="64-true")
    assert len(strategy.engine.learner_rates) == 2
    assert len(model.inputs) > 2, "the tuner's steps come first"
    assert {batch["x"].dtype for batch in model.inputs} == {torch.float64}


def test_auto_refuses_parameters_it_cannot_stack_before_measuring():
    with pytest.raises(ValueError, match=r"one dtype .*HINT"):
        _fit(_auto_strategy(), devices=1, model=_InputRecorder(), max_steps=2, precision="bf16-true")


def test_auto_refuses_a_loader_without_a_batch_to_time():
    model = _InputRecorder()
    model.train_dataloader = lambda: DataLoader(RegressionData(3), batch_size=4, drop_last=True)
    with pytest.raises(ValueError, match=r"gave none .*HINT"):
        _fit(_auto_strategy(), devices=1, model=model, max_steps=2)


def _saved_momenta(path) -> list[tuple[int, ...]]:
    state = torch.load(path, weights_only=False)["optimizer_states"][0]["state"]
    return [tuple(entry["momentum_buffer"].shape) for entry in state.values()]


ONE_MODEL = [(16, 8), (16,), (1, 16), (1,)]


def test_checkpoints_cross_between_learners_one_learner_and_lightnings_own_strategy(tmp_path):
    def save(strategy, name: str) -> str:
        checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, filename=name)
        _fit(strategy, 1, max_steps=3, callbacks=[checkpoint], enable_checkpointing=True)
        return str(tmp_path / f"{name}.ckpt")

    stacked = save(_strategy(2, start_method="popen"), "learners")
    assert _saved_momenta(stacked) == ONE_MODEL, "a checkpoint holds one model's optimizer state"
    gradients = save(AdaptiveElasticStrategy(sync="gradients"), "gradients")
    for strategy, path in [
        (_strategy(2, start_method="popen"), gradients),  # one model's momenta, a copy per learner
        (_strategy(4, start_method="popen"), stacked),  # 8 samples a step split among 4 learners
        (AdaptiveElasticStrategy(sync="gradients"), stacked),
        ("auto", stacked),  # Lightning's own single-device strategy
    ]:
        pl.seed_everything(7)
        model = LearnerModel(momentum=0.9)
        trainer = cpu_trainer(strategy, devices=1, max_steps=6)
        trainer.fit(model, ckpt_path=path)
        assert trainer.global_step == 6
        assert [tuple(p.shape) for p in model.parameters()] == ONE_MODEL
        momenta = [tuple(s["momentum_buffer"].shape) for s in trainer.optimizers[0].state.values()]
        assert momenta == ONE_MODEL, "the module leaves fit one model, and so does its optimizer"
        assert torch.isfinite(flat_parameters(model)).all()


def test_a_mid_epoch_checkpoint_whose_steps_the_learners_cannot_split_fails_with_a_hint(tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, filename="{step}")
    _fit(_strategy(2, start_method="popen"), 1, max_steps=3, callbacks=[checkpoint], enable_checkpointing=True)
    trainer = cpu_trainer(_strategy(3, start_method="popen"), devices=1, max_steps=6)
    with pytest.raises(ValueError, match=r"steps of 8 samples, which 3 learners .* HINT: resume with a "):
        trainer.fit(LearnerModel(momentum=0.9), ckpt_path=str(tmp_path / "step=3.ckpt"))


class _AdafactorModel(LearnerModel):
    def configure_optimizers(self):
        return torch.optim.Adafactor(self.parameters())


class _LionLike(torch.optim.Optimizer):
    """An optimizer torch does not ship: sign descent, elementwise, as Lion's update is."""

    def __init__(self, params, lr: float = 0.01) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            with torch.enable_grad():
                closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.add_(param.grad.sign(), alpha=-group["lr"])


class _LionModel(LearnerModel):
    def configure_optimizers(self):
        return _LionLike(self.parameters())


def test_an_optimizer_reading_whole_tensors_is_refused_and_an_unknown_one_is_warned_of():
    with pytest.raises(UnsupportedSettingError, match=r"Adafactor, whose update of a tensor reads the whole.*HINT"):
        _fit(_strategy(2, start_method="popen"), 1, model=_AdafactorModel(), max_steps=2)
    with pytest.warns(UserWarning, match=r"_LionLike: the learners are stacked .*LAMB's or LARS's trust ratio"):
        _fit(_strategy(2, start_method="popen"), 1, model=_LionModel(), max_steps=2)
