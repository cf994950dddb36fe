"""The engine that the strategy's hooks delegate to, driven directly in one process."""

from __future__ import annotations

import math
import time
from dataclasses import fields

import pytest
import torch
from helpers import FakeCommunicator, RegressionData
from torch.utils.data import DataLoader

from lightning_aesgd.core.lr import InverseTimeDecay
from lightning_aesgd.core.merge import SMA, ElasticAverage
from lightning_aesgd.core.sensing import PeriodReport
from lightning_aesgd.emulation import StepStretcher
from lightning_aesgd.emulation.profiles import as_profile
from lightning_aesgd.engine import stalls
from lightning_aesgd.engine.averager import MergeSettings
from lightning_aesgd.engine.comm import LocalCommunicator, ReplicaStalledError
from lightning_aesgd.engine.model_merge import ModelMerge, NonFiniteReplicasError
from lightning_aesgd.engine.pipeline import TrainerHooks
from lightning_aesgd.engine.plan_settings import PlanSettings
from lightning_aesgd.engine.stalls import RollCall


def _engine(merging: MergeSettings | None = None, **options) -> ModelMerge:
    defaults = {"l2_nudge": False, "lr_scaling": False, "lr_schedule": None, "step_batch_size": None}
    defaults |= {"plan_lag": None, "sample_costs": None, "checkpoint_replicas": True}
    return ModelMerge(merging or MergeSettings(ElasticAverage()), PlanSettings(), **(defaults | options))


def _started(
    module: torch.nn.Module, hooks: TrainerHooks | None = None, **engine_kwargs
) -> tuple[ModelMerge, DataLoader]:
    engine = _engine(**engine_kwargs)
    engine.start(module, LocalCommunicator(), torch.device("cpu"), hooks)
    loader = engine.training_loader(DataLoader(RegressionData(32), batch_size=4))
    return engine, loader


def _steps(engine: ModelMerge, loader: DataLoader, optimizer: torch.optim.Optimizer, body=lambda: None):
    for index, _ in enumerate(loader):
        engine.begin_step(0, index, index)
        engine.optimizer_step(optimizer, body)


def test_the_step_emulation_counts_as_busy_time():
    module = torch.nn.Linear(2, 1)
    engine, loader = _started(module)
    engine.compute_spans = StepStretcher(as_profile([3.0]), torch.device("cpu"))
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    computes = []

    def work() -> None:  # real CPU work, its compute time measured as the emulation measures it
        started = time.process_time()
        sum(i * i for i in range(50_000))
        computes.append(time.process_time() - started)

    _steps(engine, loader, optimizer, work)
    compute = computes[-1]
    # The device "took" its real time plus 2× its compute time (3× in all); sleeps never end early.
    assert engine.plans.stats()[0].busy_seconds >= 2.5 * compute


def test_only_the_step_mode_is_emulated_inside_the_strategy():
    from lightning_aesgd import AdaptiveElasticStrategy

    hook = as_profile({"factors": [2.0], "mode": "hook", "seconds_per_sample": 0.001})
    assert AdaptiveElasticStrategy(slowdown=hook).slowdown is None
    assert AdaptiveElasticStrategy(slowdown=[2.0]).slowdown is not None


def test_lr_scaling_scales_only_inside_the_step():
    module = torch.nn.Linear(2, 1)
    engine, loader = _started(module, lr_scaling=True, step_batch_size=8)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    seen = []
    _steps(engine, loader, optimizer, lambda: seen.append(optimizer.param_groups[0]["lr"]))
    # One replica takes the whole step batch of 8 where the nominal per-replica batch is 8: factor 1.
    assert seen == [pytest.approx(0.1)] * len(loader)
    assert optimizer.param_groups[0]["lr"] == 0.1


def test_lr_schedule_multiplies_the_rate_by_its_factor_of_the_global_step_inside_the_step_only():
    module = torch.nn.Linear(2, 1)
    engine, loader = _started(module, lr_schedule=InverseTimeDecay(decay=1.0, warmup_steps=2, warmup_start=0.5))
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    seen = []
    _steps(engine, loader, optimizer, lambda: seen.append(optimizer.param_groups[0]["lr"]))
    factors = [0.5, 0.75, 1.0, 0.5, 1 / 3, 0.25, 0.2, 1 / 6]
    assert seen == [pytest.approx(0.1 * factor) for factor in factors[: len(loader)]]
    assert optimizer.param_groups[0]["lr"] == 0.1


def test_lr_schedule_must_be_callable():
    with pytest.raises(TypeError, match="lr_schedule"):
        _engine(lr_schedule=0.05)


def test_a_learning_rate_drop_resets_the_replica_to_the_center_for_sma_only():
    module = torch.nn.Linear(2, 1)
    engine, loader = _started(module, merging=MergeSettings(SMA(alpha=0.1)))
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    resets = []
    engine.averager.reset_to_center = lambda: resets.append(True)  # type: ignore[method-assign]
    for index, _ in enumerate(loader):
        optimizer.param_groups[0]["lr"] = 0.1 if index < 3 else 0.01
        engine.begin_step(0, index, index)
        engine.optimizer_step(optimizer, lambda: None)
    assert resets == [True]


def test_training_state_round_trips_through_a_new_engine():
    module = torch.nn.Linear(2, 1)
    engine, loader = _started(module, l2_nudge=True)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    _steps(engine, loader, optimizer, lambda: [p.data.add_(0.01) for p in module.parameters()])
    state = engine.training_state(optimizer)
    fresh_module = torch.nn.Linear(2, 1)
    fresh, _ = _started(fresh_module, l2_nudge=True)
    fresh.load_training_state(state, torch.optim.SGD(fresh_module.parameters(), lr=0.1), torch.device("cpu"))
    assert fresh.averager.local_steps == engine.averager.local_steps == len(loader)
    assert fresh.normalization.state_dict() == engine.normalization.state_dict()
    torch.testing.assert_close(fresh.averager.local_model()[0], engine.averager.local_model()[0])


@pytest.mark.parametrize(("taker", "keeps_checkpoint_model"), [(0, False), (1, True)])
def test_resuming_while_a_merge_is_owed_gives_left_out_replicas_the_global_model(taker, keeps_checkpoint_model):
    module = torch.nn.Linear(2, 1)
    engine, loader = _started(module)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    _steps(engine, loader, optimizer, lambda: [p.data.add_(0.01) for p in module.parameters()])
    state = engine.training_state(optimizer)
    state["shared"]["alone"] = {"taker": taker, "steps": 3, "owes_merge": 1}  # replica `taker` trained alone
    fresh_module = torch.nn.Linear(2, 1)
    global_model = [p.detach().clone() for p in fresh_module.parameters()]  # what the checkpoint's state_dict loaded
    fresh, _ = _started(fresh_module)
    fresh.load_training_state(state, torch.optim.SGD(fresh_module.parameters(), lr=0.1), torch.device("cpu"))
    assert fresh.alone.owes_merge
    kept = all(torch.equal(old, new) for old, new in zip(global_model, fresh_module.parameters(), strict=True))
    assert kept == keeps_checkpoint_model  # rank 0 is the lone replica (its own model) or a left-out one (global)


def test_a_lone_replica_that_is_not_finite_stops_training_with_the_fix():
    module = torch.nn.Linear(2, 1)
    engine, loader = _started(module)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)

    def poison() -> None:
        module.weight.data.fill_(float("nan"))

    batches = iter(loader)
    next(batches)
    engine.begin_step(0, 0, 0)
    with pytest.raises(NonFiniteReplicasError, match=r"Every replica's model \(\[0\]\).*HINT"):
        engine.optimizer_step(optimizer, poison)


def test_a_model_whose_sum_overflows_merges_again_and_stays_in():
    module = torch.nn.Linear(2, 1)
    with torch.no_grad():
        module.weight.fill_(3e38)  # finite, but their sum is not: the finite flag the merge sends says "not finite"
    engine, loader = _started(module, merging=MergeSettings(ElasticAverage(), weights="uniform"))  # w·θ stays finite
    reduce, weights = engine.averager.reduce, []

    def counted_reduce(weight, optimizer, row):
        weights.append(weight)
        return reduce(weight, optimizer, row)

    engine.averager.reduce = counted_reduce  # type: ignore[method-assign]
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    next(iter(loader))
    engine.begin_step(0, 0, 0)
    engine.optimizer_step(optimizer, lambda: None)
    assert len(weights) == 2  # sent on the device as 0, then again with the weight the host checked
    assert float(weights[0]) == 0.0
    assert weights[1] == 1.0
    assert engine.exclusion_count == 0
    assert engine.plans.latest_reports[0].finite == 1.0
    assert bool((module.weight == 3e38).all())  # merged with itself, not restored


class _RankZeroSends(FakeCommunicator):
    """Peers whose broadcasts deliver rank zero's tensor, here: every element 7."""

    def broadcast_(self, tensor, src=0):
        super().broadcast_(tensor, src)
        tensor.fill_(7.0)


def test_a_fit_starts_every_replica_from_rank_zeros_parameters_frozen_ones_included():
    module = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    module[0].requires_grad_(False)  # an unseeded frozen layer would differ between replicas
    _engine().start(module, _RankZeroSends(world_size=2, rank=1), torch.device("cpu"))
    assert all(bool((parameter == 7.0).all()) for parameter in module.parameters())


def test_the_l2_gate_follows_rank_zeros_gathered_norm_and_is_judged_afresh_each_evaluation():
    module = torch.nn.Linear(2, 1)
    engine, loader = _started(module, l2_nudge=True)  # 8 steps, a merge after each
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    center_norm = [f.name for f in fields(PeriodReport)].index("center_norm")
    # Rank zero's norms as the merge gathers them: rising, a dip, then (a new window) rising again.
    gathered = iter([1.0, 2.0, 1.5, 1.7, 2.0, 3.0, 4.0, 5.0])
    reduce = engine.averager.reduce

    def scripted_reduce(weight, optimizer, row):
        reduced = reduce(weight, optimizer, row)
        reduced.rows[0][center_norm] = next(gathered)
        return reduced

    engine.averager.reduce = scripted_reduce  # type: ignore[method-assign]
    active = []
    for index, _ in enumerate(loader):
        if index == 4:  # an evaluation pass between steps 3 and 4
            engine.begin_evaluation()
            engine.end_evaluation()
        engine.begin_step(0, index, index)
        engine.optimizer_step(optimizer, lambda: None)
        active.append(engine.normalization.trend.active)
    assert active == [True, True, False, False, True, True, True, True]
    assert engine.normalization.trend.previous_norm == 5.0  # the gathered value, not this replica's own norm


class _ScriptedScaler:
    """A GradScaler's interface as the engine reads it: the loss scale halves on the steps it skips."""

    def __init__(self, skip_at: set[int]) -> None:
        self._scale = torch.tensor(1024.0)
        self.skip_at = skip_at
        self.steps = 0

    def is_enabled(self) -> bool:
        return True

    def get_scale(self) -> float:
        return float(self._scale)

    def step_body(self) -> None:
        if self.steps in self.skip_at:
            self._scale = self._scale / 2
        self.steps += 1


def test_a_step_the_grad_scaler_skipped_carries_no_merge_weight():
    module = torch.nn.Linear(2, 1)
    scaler = _ScriptedScaler(skip_at={0, 2, 5, 6})
    engine, loader = _started(
        module, TrainerHooks(grad_scaler=scaler), merging=MergeSettings(ElasticAverage(), period=2)
    )
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    weights = []
    for index, _ in enumerate(loader):
        engine.begin_step(0, index, index)
        engine.optimizer_step(optimizer, scaler.step_body)
        if engine.synced_last_step and engine.plans.latest_reports:
            weights.append(engine.plans.latest_reports[0].merge_weight)
    # Steps of 4 samples, merges after steps 0, 2, 4 and 6. Step 0 alone, skipped: nothing to merge (skipped, not
    # an error). Steps 1-2 with 2 skipped: 4 samples of weight. Steps 3-4: 8. Steps 5-6, both skipped: nothing.
    assert weights == [0.0, 4.0, 8.0, 0.0]
    assert engine.averager.merges == 2


def test_the_steps_a_real_grad_scaler_skips_carry_no_merge_weight():
    module = torch.nn.Linear(2, 1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)  # its scale is made at the first scaled loss
    engine, loader = _started(
        module, TrainerHooks(grad_scaler=scaler), merging=MergeSettings(ElasticAverage(), period=2)
    )
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)

    def step(overflow: bool) -> None:  # what Lightning's optimizer step does under 16-mixed
        optimizer.zero_grad()
        loss = module(torch.ones(4, 2)).sum() * (math.inf if overflow else 1.0)
        scaler.scale(loss).backward()
        scaler.step(optimizer)  # skipped where the gradients are not finite; the scale then halves
        scaler.update()

    weights = []
    for index, _ in enumerate(loader):
        engine.begin_step(0, index, index)
        engine.optimizer_step(optimizer, lambda index=index: step(index in {0, 2, 5, 6}))
        if engine.synced_last_step and engine.plans.latest_reports:
            weights.append(engine.plans.latest_reports[0].merge_weight)
    assert weights == [0.0, 4.0, 8.0, 0.0]  # as with the scripted scaler above
    assert engine.averager.merges == 2
    assert scaler.get_scale() == 1024.0 / 2**4


def test_a_merge_period_of_steps_weighs_as_one_report_in_the_speed_models():
    """Reports come once per merge: a period longer than lag + 1 does not make every report weigh more."""
    engine = _engine(MergeSettings(ElasticAverage(), period=8))
    engine.start(torch.nn.Linear(2, 1), LocalCommunicator(), torch.device("cpu"))
    engine.training_loader(DataLoader(RegressionData(32), batch_size=4))
    assert engine.plans.arrival_model is not None
    assert engine.plans.arrival_model.reference_steps == 8


class _LostPeer(LocalCommunicator):
    """A peer that stops answering once training is under way: every later all-reduce stalls.

    It notes what the replica said it was doing (``stalls.doing``), which a real communicator puts in its error.
    """

    def __init__(self) -> None:
        self.lost = False
        self.doing: list[str] = []

    def all_reduce_sum_(self, tensor):
        if self.lost:
            task = stalls.now_doing()
            self.doing.append("nothing" if task is None else task.where)
            roll = RollCall(waited={0: 20.0}, arrived={0: 100.0}, absent=(1,))
            raise ReplicaStalledError(
                collective="all-reduce #7", rank=0, world_size=2, waited=20.0, roll=roll, cause="Connection reset"
            )


@pytest.mark.parametrize("collective", ["begin_evaluation", "finish"])
def test_a_stall_in_the_global_models_mean_names_what_the_replica_was_doing(collective):
    module = torch.nn.Linear(2, 1)
    comm = _LostPeer()
    engine = _engine()
    engine.start(module, comm, torch.device("cpu"))
    comm.lost = True
    with pytest.raises(ReplicaStalledError):
        getattr(engine, collective)()
    assert len(comm.doing) == 1
    assert "the global model's mean" in comm.doing[0]
    assert ("evaluation" if collective == "begin_evaluation" else "end of fit") in comm.doing[0]
