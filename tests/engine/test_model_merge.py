"""The engine that the strategy's hooks delegate to, driven directly in one process."""

from __future__ import annotations

import logging
import math
import time
import warnings
from dataclasses import fields, replace

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
from lightning_aesgd.engine.comm import LocalCommunicator, NoMergeWeightError, ReplicaStalledError
from lightning_aesgd.engine.learner_tuning import LearnerTuning
from lightning_aesgd.engine.model_merge import MAX_STEPS_ALONE, ModelMerge, NonFiniteReplicasError, TrainingAlone
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
    """Peers whose broadcasts deliver rank zero's tensor, here: every element 7 (another rank's: -1)."""

    def broadcast_(self, tensor, src=0):
        super().broadcast_(tensor, src)
        tensor.fill_(7.0 if src == 0 else -1.0)


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


def test_auto_learners_start_as_one_undecided_learner_until_chosen_with_the_given_tuning():
    tuning = LearnerTuning(max_learners=2, min_gain=0.5)
    engine = _engine(learners="auto", learner_tuning=tuning)
    assert (engine.auto_learners, engine.learners) == (True, 1)
    assert engine.learner_tuning is tuning
    assert not engine.learners_undecided  # not running yet
    engine.start(torch.nn.Linear(2, 1), LocalCommunicator(), torch.device("cpu"))
    assert engine.learners_undecided
    assert engine.choose_learners(lambda learners: 100.0 * learners) == 2  # doubled: kept, and the most allowed
    assert (engine.learners, engine.learner_rates) == (2, [100.0, 200.0])
    assert not engine.learners_undecided
    engine.stop()
    engine.start(torch.nn.Linear(2, 1), LocalCommunicator(), torch.device("cpu"))  # each fit chooses anew
    assert (engine.learners, engine.learner_rates, engine.learners_undecided) == (1, [], True)


def test_a_fixed_number_of_learners_is_decided_from_the_start():
    engine = _engine(learners=3)
    engine.start(torch.nn.Linear(2, 1), LocalCommunicator(), torch.device("cpu"))
    assert (engine.auto_learners, engine.learners, engine.learners_undecided) == (False, 3, False)
    assert engine.learner_step.learners == 3  # one batched step trains them all


@pytest.mark.parametrize("learners", [1, 2])
def test_only_several_learners_get_a_batched_learner_step(learners):
    engine = _engine(learners=learners)
    engine.start(torch.nn.Linear(2, 1), LocalCommunicator(), torch.device("cpu"))
    assert (engine.learner_step.learners if engine.learner_step else None) == (learners if learners > 1 else None)


def test_lr_scaling_with_sample_merge_weights_warns_at_the_users_line_and_either_alone_does_not():
    from lightning_aesgd import AdaptiveElasticStrategy

    with pytest.warns(UserWarning, match="weighs large batches twice") as record:
        AdaptiveElasticStrategy(sync="models", lr_scaling=True, merge_weights="samples")
    assert [warning.filename for warning in record] == [__file__]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*weighs large batches twice")
        _engine(MergeSettings(ElasticAverage(), weights="updates"), lr_scaling=True)
        _engine(MergeSettings(ElasticAverage(), weights="samples"), lr_scaling=False)


@pytest.mark.parametrize("l2_nudge", [True, False])
def test_reports_carry_the_merged_models_norm_from_the_second_merge_only_with_the_l2_nudge(l2_nudge):
    module = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    for _ in range(2):  # a second fit starts without a norm again
        engine, loader = _started(module, l2_nudge=l2_nudge)
        norms = []
        for index, _ in enumerate(loader):
            engine.begin_step(0, index, index)
            engine.optimizer_step(optimizer, lambda: None)
            norms.append(engine.plans.latest_reports[0].center_norm)
        engine.stop()
        merged_norm = torch.cat([p.detach().flatten() for p in module.parameters()]).norm().item()
        later = [pytest.approx(merged_norm) if l2_nudge else -1.0] * (len(norms) - 1)
        assert norms == [-1.0, *later]  # -1: no norm yet


def test_the_summary_counts_the_fits_merges_and_names_the_learners_only_when_several_or_auto():
    module = torch.nn.Linear(2, 1)
    engine, loader = _started(module, merging=MergeSettings(ElasticAverage(), period=2))
    _steps(engine, loader, torch.optim.SGD(module.parameters(), lr=0.1))
    assert engine.sync_count == 4
    record = engine.summary_record()
    assert (record["syncs"], record["sync_name"]) == (4, "merges")
    assert "learners" not in record
    module = torch.nn.Linear(2, 1)
    engine, loader = _started(module, learners=2)
    assert engine.summary_record() is None  # no merge yet
    _steps(engine, loader, torch.optim.SGD(module.parameters(), lr=0.1))
    assert engine.summary_record()["learners"] == {"per_replica": 2, "measured": []}


@pytest.mark.parametrize("rank", [0, 1])
def test_only_rank_zero_logs_the_job_rates_that_auto_chose_the_learners_by(rank, caplog):
    engine = _engine(learners="auto", learner_tuning=LearnerTuning(max_learners=2))
    engine.start(torch.nn.Linear(2, 1), FakeCommunicator(world_size=2, rank=rank), torch.device("cpu"))
    with caplog.at_level(logging.INFO, logger="lightning_aesgd.engine.model_merge"):
        assert engine.choose_learners(lambda learners: 100.0 * learners) == 2
    logged = "samples/s by learners per replica {1: 200, 2: 400}; trains 2." in caplog.text  # two replicas' sum
    assert logged == (rank == 0)


def test_a_fit_of_several_learners_names_their_stacked_shapes_and_leaves_one_model_when_it_stops():
    module = torch.nn.Linear(2, 1)
    engine = _engine(learners=2)
    engine.start(module, LocalCommunicator(), torch.device("cpu"))
    assert engine.loss_weight == 2.0  # the batched step returns the mean of the learners' losses
    assert module.weight.shape == (2, 1, 2)  # a row per learner
    assert engine.one_model_shapes() == dict(zip(map(id, module.parameters()), [(1, 2), (1,)], strict=True))
    engine.stop()
    assert module.weight.shape == (1, 2)
    assert engine.one_model_shapes() == {}


def test_stopping_an_engine_that_never_started_leaves_no_shapes_to_name():
    engine = _engine()
    engine.stop()
    assert engine.one_model_shapes() == {}


@pytest.mark.parametrize("lr_scaling", [True, False])
def test_lr_scaling_scales_a_short_last_batch_by_its_share_of_the_replicas_nominal_batch(lr_scaling):
    module = torch.nn.Linear(2, 1)
    engine = _engine(MergeSettings(ElasticAverage(), weights="updates"), lr_scaling=lr_scaling, step_batch_size=8)
    engine.start(module, FakeCommunicator(world_size=2), torch.device("cpu"))
    loader = engine.training_loader(DataLoader(RegressionData(30), batch_size=4))
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    seen = []
    _steps(engine, loader, optimizer, lambda: seen.append(optimizer.param_groups[0]["lr"]))
    # Steps of 8 samples, 4 for each of the 2 replicas (the nominal batch), then the last 6: 3 each.
    factors = [1.0, 1.0, 1.0, 0.75] if lr_scaling else [1.0] * 4
    assert seen == [pytest.approx(0.1 * factor) for factor in factors]


def _lone_run(
    takers: list, steps: int = 8, comm=None, merging=None, reports_can_wait: bool = True, **engine_kwargs
) -> tuple[ModelMerge, list[int]]:
    """Train ``steps`` steps whose plans give every sample to ``takers[step]`` alone (``None``: to several)."""
    module = torch.nn.Linear(2, 1)
    engine = _engine(merging, **({"step_batch_size": 8} | engine_kwargs))
    engine.start(module, comm or FakeCommunicator(world_size=2), torch.device("cpu"))
    loader = engine.training_loader(DataLoader(RegressionData(8 * steps), batch_size=4))
    engine.plans.lone_taker = lambda step: takers[step] if step < len(takers) else None  # type: ignore[method-assign]
    engine.plans.reports_can_wait = lambda step: reports_can_wait  # type: ignore[method-assign]
    merge, merged_after = engine._merge, []

    def recorded_merge(*args) -> None:
        merged_after.append(engine._global_step)
        merge(*args)

    engine._merge = recorded_merge  # type: ignore[method-assign]
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    for index, _ in enumerate(loader):
        engine.begin_step(0, index, index)
        assert engine.optimizer_step(optimizer, lambda: "output") == "output"
    return engine, merged_after


@pytest.mark.parametrize("rank", [0, 1])
def test_a_lone_replicas_due_merge_waits_and_happens_before_another_replica_is_planned_in(rank, caplog):
    # Merges due after steps 0, 2, 4, 6. Replica 0 takes step 0 and 1 alone: the merge after step 0 waits, and
    # happens after step 1, not due, as step 2 plans several replicas. Step 3 is replica 0's alone again, but no
    # merge is owed then.
    takers = [0, 0, None, 0, None, None, None, None]
    with caplog.at_level(logging.INFO, logger="lightning_aesgd.engine.model_merge"):
        engine, merged_after = _lone_run(
            takers, comm=FakeCommunicator(world_size=2, rank=rank), merging=MergeSettings(ElasticAverage(), period=2)
        )
    assert merged_after == [1, 2, 4, 6]
    assert engine.alone.waited == 1
    logged = caplog.text.count("Replica 0 takes every sample: merges wait until another replica is planned in.")
    assert logged == (1 if rank == 0 else 0)


def test_a_replica_alone_goes_at_most_max_steps_alone_without_a_merge():
    engine, merged_after = _lone_run([0] * (MAX_STEPS_ALONE + 2), steps=MAX_STEPS_ALONE + 2)
    # Every step is due: the first MAX_STEPS_ALONE - 1 wait, and the last as the step after it plans no one alone.
    assert merged_after == [MAX_STEPS_ALONE - 1, MAX_STEPS_ALONE + 1]
    assert engine.alone.waited == MAX_STEPS_ALONE
    assert (engine.alone.taker, engine.alone.steps, engine.alone.owes_merge) == (None, 0, False)


@pytest.mark.parametrize(
    "options",
    [
        {"comm": LocalCommunicator()},
        {"learners": 2},
        {"merging": MergeSettings(ElasticAverage(alpha=0.5))},
        {"merging": MergeSettings(ElasticAverage(momentum=0.5))},
        {"merging": MergeSettings(ElasticAverage(), optimizer_state="reset")},
        {"l2_nudge": True},
        {"reports_can_wait": False},
    ],
    ids=[
        "one replica",
        "several learners",
        "a partial pull",
        "outer momentum",
        "optimizer state reset",
        "l2 nudge",
        "a probe is due",
    ],
)
def test_a_lone_replicas_merges_wait_only_where_the_merge_would_give_it_its_own_model(options):
    _, merged_after = _lone_run([0] * 8, **options)
    assert merged_after == list(range(8))


def test_a_merge_of_finite_replicas_keeps_the_optimizer_state_and_the_weight_the_device_computed():
    module = torch.nn.Linear(2, 1)
    scaler = _ScriptedScaler(skip_at=set())  # the weight is computed on the device, read back with the rows
    engine, loader = _started(
        module, TrainerHooks(grad_scaler=scaler), merging=MergeSettings(ElasticAverage(), period=2)
    )
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)

    def step() -> None:
        scaler.step_body()
        optimizer.zero_grad()
        module(torch.ones(4, 2)).sum().backward()
        optimizer.step()

    _steps(engine, loader, optimizer, step)
    assert engine.averager.merges == 4  # after steps 0, 2, 4 and 6
    assert engine.averager.last_weight == 8.0  # steps 5 and 6, 4 samples each
    assert all("momentum_buffer" in optimizer.state[parameter] for parameter in module.parameters())


def test_a_model_whose_sum_overflows_with_every_update_skipped_skips_the_merge():
    module = torch.nn.Linear(2, 1)
    with torch.no_grad():
        module.weight.fill_(3e38)  # finite, but the finite flag the merge sends says "not finite"
    scaler = _ScriptedScaler(skip_at={0})
    engine, loader = _started(
        module, TrainerHooks(grad_scaler=scaler), merging=MergeSettings(ElasticAverage(), weights="uniform")
    )
    next(iter(loader))
    engine.begin_step(0, 0, 0)
    engine.optimizer_step(torch.optim.SGD(module.parameters(), lr=0.1), scaler.step_body)
    assert engine.averager.merges == 0  # merged again with the weight the host checked: 0, nothing to merge
    assert engine.exclusion_count == 0
    assert engine.plans.latest_reports[0].finite == 1.0
    assert bool((module.weight == 3e38).all())


@pytest.mark.parametrize("with_scaler", [False, True], ids=["weight on the host", "weight on the device"])
def test_the_merge_weight_is_the_replicas_own_weight_times_the_l2_nudges_factor(with_scaler):
    module = torch.nn.Linear(2, 1)
    scaler = _ScriptedScaler(skip_at=set())
    hooks = TrainerHooks(grad_scaler=scaler) if with_scaler else None
    engine, loader = _started(module, hooks, l2_nudge=True)
    engine.normalization.factor = lambda rank, previous, local_steps: 0.5  # type: ignore[method-assign]
    next(iter(loader))
    engine.begin_step(0, 0, 0)
    engine.optimizer_step(torch.optim.SGD(module.parameters(), lr=0.1), scaler.step_body)
    assert engine.plans.latest_reports[0].merge_weight == 2.0  # 4 samples, halved


def test_a_merge_whose_finite_replicas_all_skipped_every_update_fails_for_want_of_weight():
    module = torch.nn.Linear(2, 1)
    scaler = _ScriptedScaler(skip_at={0})
    engine = _engine()
    # The peer adds nothing to the sums: its row says weight 0 and a model that is not finite.
    comm = FakeCommunicator(world_size=2, peers_sum=torch.zeros_like)
    engine.start(module, comm, torch.device("cpu"), TrainerHooks(grad_scaler=scaler))
    loader = engine.training_loader(DataLoader(RegressionData(32), batch_size=4))
    next(iter(loader))
    engine.begin_step(0, 0, 0)
    with pytest.raises(NoMergeWeightError):  # not NonFiniteReplicasError: this replica's model is finite
        engine.optimizer_step(torch.optim.SGD(module.parameters(), lr=0.1), scaler.step_body)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_replica_left_out_of_a_merge_is_counted_on_every_rank_and_named_by_rank_zero_only(rank, caplog):
    module = torch.nn.Linear(2, 1)
    engine = _engine()
    # The peer adds nothing to the sums: its row says weight 0 and a model that is not finite.
    engine.start(module, FakeCommunicator(world_size=2, rank=rank, peers_sum=torch.zeros_like), torch.device("cpu"))
    loader = engine.training_loader(DataLoader(RegressionData(32), batch_size=4))
    next(iter(loader))
    engine.begin_step(0, 0, 0)
    with caplog.at_level(logging.WARNING, logger="lightning_aesgd.engine.model_merge"):
        engine.optimizer_step(torch.optim.SGD(module.parameters(), lr=0.1), lambda: None)
    peer = 1 - rank
    assert engine.exclusions == [(0, peer)]
    assert engine.exclusion_count == 1
    named = f"Replica {peer}'s model was not finite at step 0: left out of the merge" in caplog.text
    assert named == (rank == 0)


@pytest.mark.parametrize("swapped_in", [False, True], ids=["training", "evaluating"])
def test_the_global_models_state_for_a_checkpoint_leaves_the_module_showing_what_it_showed(swapped_in):
    module = torch.nn.Linear(2, 1)
    engine, _ = _started(module)
    if swapped_in:
        engine.begin_evaluation()
    state = engine.global_model_state(module)
    assert engine.averager.swapped_in == swapped_in
    assert set(state) == {"weight", "bias"}
    torch.testing.assert_close(state["weight"], module.weight.detach())  # one replica: its model is the global one


def test_training_state_holds_each_replicas_own_model_and_optimizer_only_with_checkpoint_replicas():
    module = torch.nn.Linear(2, 1)
    engine, _ = _started(module)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    state = engine.training_state(optimizer)
    assert (state["world_size"], state["shared"]["learners"]) == (1, 1)
    [own] = state["replicas"]
    assert own["optimizer"]["param_groups"] == optimizer.state_dict()["param_groups"]
    assert engine.training_state(None)["replicas"][0]["optimizer"] is None
    engine, _ = _started(torch.nn.Linear(2, 1), checkpoint_replicas=False)
    assert engine.training_state(optimizer)["replicas"] is None


@pytest.mark.parametrize("rank", [0, 1])
def test_the_replicas_own_parts_are_gathered_to_rank_zero_which_alone_writes_the_checkpoint(rank):
    module = torch.nn.Linear(2, 1)
    engine = _engine()
    engine.start(module, FakeCommunicator(world_size=2, rank=rank), torch.device("cpu"))
    replicas = engine.training_state(None)["replicas"]
    assert (len(replicas) if replicas is not None else None) == (2 if rank == 0 else None)


def _checkpoint(train: bool = True, **engine_kwargs) -> tuple[dict, torch.nn.Module]:
    """The training state after a fit's 8 steps (of SGD with momentum where ``train``), and the module trained."""
    module = torch.nn.Linear(2, 1)
    engine, loader = _started(module, **engine_kwargs)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)

    def step() -> None:
        optimizer.zero_grad()
        module(torch.ones(4, 2)).sum().backward()
        optimizer.step()

    _steps(engine, loader, optimizer, step if train else lambda: None)
    return engine.training_state(optimizer), module


def test_resuming_restores_the_replicas_own_model_and_optimizer_state_from_a_checkpoint_without_learners():
    state, module = _checkpoint()
    del state["shared"]["learners"]  # a checkpoint from before learners: one each
    fresh_module = torch.nn.Linear(2, 1)
    fresh, _ = _started(fresh_module)
    optimizer = torch.optim.SGD(fresh_module.parameters(), lr=0.1, momentum=0.9)
    fresh.load_training_state(state, optimizer, torch.device("cpu"))
    torch.testing.assert_close(fresh_module.weight, module.weight)
    assert all("momentum_buffer" in optimizer.state[parameter] for parameter in fresh_module.parameters())
    fresh.load_training_state(state, None, torch.device("cpu"))  # without an optimizer: the model alone
    state["replicas"][0]["optimizer"] = None  # saved without one
    fresh.load_training_state(state, torch.optim.SGD(fresh_module.parameters(), lr=0.1), torch.device("cpu"))
    torch.testing.assert_close(fresh_module.weight, module.weight)


def test_resuming_from_a_checkpoint_without_replicas_restores_only_the_shared_state():
    state, _ = _checkpoint(checkpoint_replicas=False)
    fresh_module = torch.nn.Linear(2, 1)
    global_model = fresh_module.weight.detach().clone()  # what the checkpoint's state_dict loaded
    fresh, _ = _started(fresh_module)
    fresh.load_training_state(state, None, torch.device("cpu"))
    assert fresh.averager.local_steps == 8
    assert torch.equal(fresh_module.weight, global_model)


def test_a_checkpoint_of_other_learners_starts_every_learner_from_the_merged_model(caplog):
    state, _ = _checkpoint(train=False, learners=2)
    fresh_module = torch.nn.Linear(2, 1)
    global_model = fresh_module.weight.detach().clone()
    fresh, _ = _started(fresh_module)
    with caplog.at_level(logging.WARNING, logger="lightning_aesgd.engine.model_merge"):
        fresh.load_training_state(state, None, torch.device("cpu"))
    assert "The checkpoint's replicas trained 2 learners each, this run trains 1" in caplog.text
    assert torch.equal(fresh_module.weight, global_model)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_checkpoint_of_another_world_size_starts_every_replica_from_the_merged_model(rank, caplog):
    state, _ = _checkpoint()
    fresh_module = torch.nn.Linear(2, 1)
    fresh = _engine()
    fresh.start(fresh_module, FakeCommunicator(world_size=2, rank=rank), torch.device("cpu"))
    global_model = fresh_module.weight.detach().clone()
    with caplog.at_level(logging.WARNING, logger="lightning_aesgd.engine.model_merge"):
        fresh.load_training_state(state, None, torch.device("cpu"))
    assert ("The checkpoint holds 1 replicas, this run has 2: all start from the merged model" in caplog.text) == (
        rank == 0
    )
    assert torch.equal(fresh_module.weight, global_model)


def test_auto_learners_take_a_merge_checkpoints_learners_and_measure_after_any_other():
    state, _ = _checkpoint(train=False, learners=2)
    fresh = _engine(learners="auto")
    fresh.start(torch.nn.Linear(2, 1), LocalCommunicator(), torch.device("cpu"))
    fresh.load_training_state(state, None, torch.device("cpu"))
    assert (fresh.learners, fresh.learners_undecided) == (2, False)
    gradient_sync = {**state, "shared": {k: v for k, v in state["shared"].items() if k not in ("averager", "learners")}}
    fresh = _engine(learners="auto")
    fresh.start(torch.nn.Linear(2, 1), LocalCommunicator(), torch.device("cpu"))
    fresh.load_training_state(gradient_sync, None, torch.device("cpu"))  # a checkpoint of sync="gradients"
    assert (fresh.learners, fresh.learners_undecided, fresh.averager.local_steps) == (1, True, 0)


@pytest.mark.parametrize("merge_buffers", [True, False])
def test_a_fit_starts_every_replica_from_rank_zeros_buffers_only_where_merges_average_them(merge_buffers):
    module = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    merging = MergeSettings(ElasticAverage(), merge_buffers=merge_buffers)
    _engine(merging).start(module, _RankZeroSends(world_size=2, rank=1), torch.device("cpu"))
    assert bool((module[1].running_var == 7.0).all()) == merge_buffers  # else its own: ones


@pytest.mark.parametrize("saved", [{"taker": None, "steps": 0, "owes_merge": 0}, {}], ids=["after a merge", "none"])
def test_training_alone_resumes_with_no_steps_since_a_merge_from_a_state_saved_right_after_one(saved):
    alone = TrainingAlone(taker=1, steps=5, owes_merge=True)
    alone.load_state_dict(saved)
    assert (alone.taker, alone.steps, alone.owes_merge) == (None, 0, False)


@pytest.mark.parametrize(("weights", "weight"), [("updates", 1.0), ("samples", 4.0)])
def test_an_idle_step_moves_no_parameter_and_counts_for_nothing_in_the_merge_weight(weights, weight):
    module = torch.nn.Linear(2, 1)
    engine, loader = _started(module, merging=MergeSettings(ElasticAverage(), period=2, weights=weights))
    pop_record = engine.sampler.pop_record
    # Step 1 gives this replica no sample (a plan that leaves it out): it computes a zero gradient.
    engine.sampler.pop_record = lambda key: replace(pop_record(key), num_samples=0) if key == 1 else pop_record(key)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9, weight_decay=0.5)

    def step() -> None:  # weight decay moves every parameter, even with a zero gradient
        for parameter in module.parameters():
            parameter.grad = torch.zeros_like(parameter)
        optimizer.step()

    moved, reported = [], []
    for index, _ in enumerate(loader):
        before = module.weight.detach().clone()
        engine.begin_step(0, index, index)
        engine.optimizer_step(optimizer, step)
        moved.append(not torch.equal(module.weight, before))
        if index == 2:  # the merge after steps 1 and 2
            reported.append(engine.plans.latest_reports[0].merge_weight)
    assert moved == [index != 1 for index in range(len(moved))]
    assert reported == [weight]  # step 2's 4 samples, 1 update
