"""The seeds' claims: the verdict rules, the claims' definitions, the figures they read, and a tiny run end to end."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lightning_aesgd.bench import main
from lightning_aesgd.bench.race.analysis import RunFigures
from lightning_aesgd.bench.race.benchmark import BenchResult, BenchSettings
from lightning_aesgd.bench.race.recorder import RunRecord, Validation
from lightning_aesgd.bench.race.runner import compose_config
from lightning_aesgd.bench.race.suites import WORKLOADS, Target
from lightning_aesgd.bench.seeds import claims as claims_module
from lightning_aesgd.bench.seeds import program
from lightning_aesgd.bench.seeds.claims import CLAIMS, Claim, Entrant, algorithm_exists, get_claims, same_batch_ddp
from lightning_aesgd.bench.seeds.program import (
    ClaimResult,
    SeedsOptions,
    epochs_to_target,
    judge,
    measure_claim,
    seeds_table,
)
from lightning_aesgd.bench.seeds.verdicts import (
    MIN_REPEATS,
    AllRepeatsCrashedError,
    Measured,
    Verdict,
    failed,
    median_or_none,
    not_implemented,
    separation,
    spread_text,
    strongest_rival,
)
from lightning_aesgd.bench.seeds.verdicts import judge as judge_entrants

# --- verdicts -------------------------------------------------------------------------------------------------


def _m(name: str, *times: float | None, final: float | None = 0.93) -> Measured:
    return Measured(name, times=tuple(times), finals=(final,) * len(times))


def _status(candidate: Measured, *rivals: Measured) -> str:
    return judge_entrants(candidate, rivals).status


def test_beyond_every_rivals_spread_over_five_repeats_is_reproduced():
    candidate = _m("adaptive", 4.0, 4.4, 4.2, 4.1, 4.3)
    rivals = [_m("equal", 6.0, 6.1, 6.2, 6.3, 6.4), _m("ddp", 5.0, 5.2, 5.1, 5.3, 5.4)]
    verdict = judge_entrants(candidate, rivals, metric="P@1")
    assert verdict == Verdict(
        "reproduced",
        "median time to target: adaptive 4.2 s = 0.81× ddp's 5.2 s (0.68× equal's); final P@1 0.9300 "
        "(best rival 0.9300); every repeat beat every repeat of equal, ddp",
        "ddp",
        "adaptive 4.0–4.4 s (5 repeats), ddp 5.0–5.4 s (5 repeats); ratio 0.74–0.88",
    )


def test_faster_in_median_but_within_the_spread_is_a_tie():
    candidate = _m("adaptive", 4.1, 4.3, 4.4, 4.6, 5.0)  # median 0.86× DDP's, slowest repeat after DDP's fastest
    rival = _m("ddp", 4.6, 5.0, 5.1, 5.3, 6.2)
    verdict = judge_entrants(candidate, [rival])
    assert verdict.status == "tie"
    assert verdict.measured.endswith("repeats overlap ddp")
    assert verdict.spread == "adaptive 4.1–5.0 s (5 repeats), ddp 4.6–6.2 s (5 repeats); ratio 0.66–1.09"


def test_equal_extremes_are_not_beyond_the_spread():
    assert _status(_m("a", 1.0, 1.0, 1.0, 1.0, 2.0), _m("b", 2.0, 3.0, 3.0, 3.0, 3.0)) == "tie"
    assert _status(_m("a", 2.0, 3.0, 3.0, 3.0, 3.0), _m("b", 1.0, 1.0, 1.0, 1.0, 2.0)) == "tie"


def test_four_repeats_never_reproduce_however_far_apart():
    verdict = judge_entrants(_m("adaptive", 1.0, 1.0, 1.0, 1.0), [_m("ddp", 9.0, 9.0, 9.0, 9.0, 9.0)])
    assert verdict.status == "tie"
    assert verdict.measured.endswith("too few repeats to tell (4 < 5)")
    assert _status(_m("adaptive", 1.0, 1.0, 1.0, 1.0, 1.0), _m("ddp", 9.0, 9.0, 9.0, 9.0)) == "tie"
    assert _status(_m("adaptive", 9.0, 9.0, 9.0, 9.0), _m("ddp", 1.0, 1.0, 1.0, 1.0)) == "tie"  # nor refute
    assert MIN_REPEATS == 5


def test_beyond_the_spread_on_the_wrong_side_is_not_reproduced():
    verdict = judge_entrants(_m("adaptive", 6.0, 6.5, 7.0, 6.2, 6.1), [_m("ddp", 4.0, 4.1, 4.2, 4.3, 4.4)])
    assert verdict.status == "not reproduced"
    assert verdict.measured.endswith("every repeat came after every repeat of ddp")


def test_every_fair_rival_is_judged_and_the_strongest_is_shown():
    candidate = _m("adaptive", 4.0, 4.1, 4.2, 4.3, 4.4)
    strongest = _m("ddp", 5.0, 5.1, 5.2, 5.3, 5.4)
    noisy = _m("sma", 3.0, 6.0, 6.0, 6.0, 9.0)  # a worse median, but a repeat faster than the candidate's
    verdict = judge_entrants(candidate, [noisy, strongest])
    assert (verdict.status, verdict.rival) == ("tie", "ddp")
    assert verdict.measured.endswith("repeats overlap sma")
    beaten = _m("sma", 1.0, 1.1, 1.2, 1.3, 1.4)  # beats the candidate beyond the spread: refutes the claim
    assert _status(candidate, strongest, beaten) == "not reproduced"


def test_the_strongest_rival_has_the_best_median_not_the_best_repeat():
    lucky = _m("sma", 1.0, 8.0, 8.0, 8.0, 8.0)
    steady = _m("ddp", 5.0, 5.0, 5.0, 5.0, 5.0)
    assert strongest_rival([lucky, steady]).name == "ddp"
    assert strongest_rival([_m("sma", None, None, 1.0), _m("ddp", 9.0, 9.0, None)]).name == "ddp"
    assert strongest_rival([_m("sma", 5.0, 1.0), _m("ddp", 5.0, 2.0)]).name == "sma"  # equal medians: fastest


def test_a_missed_target_counts_as_infinitely_late():
    candidate = _m("adaptive", 4.0, 4.1, 4.2, 4.3, 4.4)
    assert _status(candidate, _m("ddp", None, None, None, None, None)) == "reproduced"
    assert _status(candidate, _m("ddp", 5.0, 5.0, 5.0, 5.0, None)) == "reproduced"
    assert _status(_m("adaptive", 4.0, 4.1, 4.2, 4.3, None), _m("ddp", 5.0, 5.0, 5.0, 5.0, 5.0)) == "tie"
    assert _status(_m("adaptive", None, None, None, None, None), _m("ddp", 5.0, 5.0, 5.0, 5.0, 5.0)) == (
        "not reproduced"
    )


def test_nobody_at_the_target_in_most_repeats_is_inconclusive():
    verdict = judge_entrants(_m("adaptive", None, None, 1.0, None, None), [_m("ddp", None, None, None, 2.0, None)])
    assert verdict.status == "inconclusive"
    assert verdict.measured.startswith("median time to target: adaptive not reached; ddp not reached")
    assert spread_text(_m("a", None), _m("b", None)) == (
        "a never at the target (1 repeat), b never at the target (1 repeat); ratio –"
    )


def test_beyond_the_spread_but_less_accurate_than_tolerated_is_partly_reproduced():
    times = (4.0, 4.1, 4.2, 4.3, 4.4)
    rival = _m("ddp", 5.0, 5.1, 5.2, 5.3, 5.4, final=0.95)
    assert _status(_m("adaptive", *times, final=0.935), rival) == "partly reproduced"
    assert _status(_m("adaptive", *times, final=0.945), rival) == "reproduced"  # within 0.01
    assert judge_entrants(_m("adaptive", *times, final=0.935), [rival], tolerance=0.02).status == "reproduced"
    assert _status(_m("adaptive", *times, final=None), rival) == "partly reproduced"  # no final metric: not kept


def test_an_all_crashed_rival_raises_naming_it():
    candidate = _m("adaptive", 4.0, 4.1, 4.2, 4.3, 4.4)
    with pytest.raises(AllRepeatsCrashedError, match="every repeat of sma crashed") as raised:
        judge_entrants(candidate, [_m("ddp", 5.0, 5.1, 5.2, 5.3, 5.4), Measured("sma", crashed=5)])
    assert raised.value.names == ("sma",)
    with pytest.raises(AllRepeatsCrashedError, match="adaptive"):
        judge_entrants(Measured("adaptive", crashed=5), [_m("ddp", 5.0)])


def test_crashed_repeats_are_shown_and_not_counted():
    candidate = Measured("adaptive", times=(4.0, 4.1, 4.2, 4.3), finals=(0.93,) * 4, crashed=1)
    verdict = judge_entrants(candidate, [_m("ddp", 5.0, 5.1, 5.2, 5.3, 5.4)])
    assert verdict.status == "tie"  # four finished repeats
    assert verdict.spread.startswith("adaptive 4.0–4.3 s (4 repeats, 1 crashed)")


def test_a_claim_needs_a_rival():
    with pytest.raises(ValueError, match="rival"):
        judge_entrants(_m("adaptive", 1.0), [])
    assert not_implemented("x missing") == Verdict("not implemented", "not implemented: x missing")
    assert failed("every repeat of ddp crashed") == Verdict("failed", "failed: every repeat of ddp crashed")


# The rules as properties: times on a coarse grid make equal and overlapping extremes common.
_TIME = st.one_of(st.none(), st.integers(1, 12).map(float))
_FIVE_OR_MORE = st.lists(_TIME, min_size=MIN_REPEATS, max_size=7)
_FEWER = st.lists(_TIME, min_size=1, max_size=MIN_REPEATS - 1)


def _late(times: Sequence[float | None]) -> list[float]:
    return [float("inf") if t is None else t for t in times]


@given(_FIVE_OR_MORE, _FIVE_OR_MORE)
def test_with_enough_repeats_the_verdict_is_the_separation_of_the_repeats(own: list, theirs: list):
    status = _status(_m("a", *own), _m("b", *theirs))
    everybody_missed = median_or_none(own) is None and median_or_none(theirs) is None
    if everybody_missed:
        assert status == "inconclusive"
    else:
        assert (status == "reproduced") == (max(_late(own)) < min(_late(theirs)))
        assert (status == "not reproduced") == (min(_late(own)) > max(_late(theirs)))
        assert status in {"reproduced", "not reproduced", "tie"}


@given(st.one_of(st.tuples(_FEWER, _FIVE_OR_MORE), st.tuples(_FIVE_OR_MORE, _FEWER), st.tuples(_FEWER, _FEWER)))
def test_fewer_than_five_repeats_of_either_side_can_only_tie(lists: tuple[list, list]):
    assert _status(_m("a", *lists[0]), _m("b", *lists[1])) in {"tie", "inconclusive"}


@given(_FIVE_OR_MORE, _FIVE_OR_MORE)
def test_a_faster_median_within_the_spread_is_a_tie(own: list, theirs: list):
    c, r = _late(own), _late(theirs)
    faster_median = median_or_none(own) is not None and _late([median_or_none(own)]) < _late([median_or_none(theirs)])
    if faster_median and max(c) >= min(r) and min(c) <= max(r):
        assert _status(_m("a", *own), _m("b", *theirs)) == "tie"


@given(_FIVE_OR_MORE, _FIVE_OR_MORE)
def test_swapping_candidate_and_rival_swaps_reproduced_and_not_reproduced(own: list, theirs: list):
    forward, backward = _status(_m("a", *own), _m("b", *theirs)), _status(_m("b", *theirs), _m("a", *own))
    swapped = {"reproduced": "not reproduced", "not reproduced": "reproduced"}
    assert backward == swapped.get(forward, forward)


@given(_FIVE_OR_MORE, _FIVE_OR_MORE, st.integers(2, 1000))
def test_the_verdict_does_not_depend_on_the_clocks_unit(own: list, theirs: list, scale: int):
    def scaled(times: list) -> list:
        return [None if t is None else t * scale / 7 for t in times]

    assert _status(_m("a", *own), _m("b", *theirs)) == _status(_m("a", *scaled(own)), _m("b", *scaled(theirs)))


@given(_FIVE_OR_MORE, st.lists(_FIVE_OR_MORE, min_size=2, max_size=3))
def test_several_rivals_reproduce_only_what_each_alone_would(own: list, rivals: list):
    candidate = _m("a", *own)
    named = [_m(f"r{i}", *times) for i, times in enumerate(rivals)]
    alone = [_status(candidate, rival) for rival in named]
    together = _status(candidate, *named)
    if together == "reproduced":
        assert set(alone) == {"reproduced"}
    if "not reproduced" in alone:
        assert together == "not reproduced"
    if set(alone) == {"reproduced"}:
        assert together == "reproduced"


@given(st.lists(_FIVE_OR_MORE, min_size=1, max_size=4))
def test_the_strongest_rival_has_the_lowest_median(rivals: list):
    named = [_m(f"r{i}", *times) for i, times in enumerate(rivals)]
    best = min(float("inf") if r.time_to_target is None else r.time_to_target for r in named)
    shown = strongest_rival(named).time_to_target
    assert (float("inf") if shown is None else shown) == best


@given(_FIVE_OR_MORE, _FIVE_OR_MORE)
def test_separation_is_the_spread_of_the_ratios(own: list, theirs: list):
    side = separation(_m("a", *own), _m("b", *theirs))
    c, r = _late(own), _late(theirs)
    ratios = [x / y for x in c for y in r if not (x == y == float("inf"))]
    if side == "faster":
        assert max(ratios) < 1
    if side == "slower":
        assert min(ratios) > 1


def test_medians_count_a_missed_target_as_infinitely_late():
    assert median_or_none([3.0, 1.0, 2.0]) == 2.0
    assert median_or_none([1.0, None]) is None  # the median of 1 and ∞
    assert median_or_none([]) is None
    figures = Measured("ddp", times=(3.0, None, 1.0), epochs=(0.5, None, 0.25), finals=(0.9, 0.8, None))
    assert (figures.repeats, figures.time_to_target, figures.epochs_to_target) == (3, 3.0, 0.5)
    assert figures.final_metric == pytest.approx(0.85)
    assert figures.span() == (1.0, float("inf"))


# --- claims ---------------------------------------------------------------------------------------------------


def test_every_claim_is_well_formed():
    assert [claim.key for claim in CLAIMS] == [
        "adaptive_sgd",
        "crossbow",
        "crossbow_learners",
        "crossbow_learners_gpu",
        "abs_sgd",
        "adaptive_hogbatch",
    ]
    for claim in CLAIMS:
        names = [entrant.name for entrant in claim.entrants]
        assert len(set(names)) == len(names), claim.key
        assert claim.candidate in names, claim.key
        assert set(claim.rivals) <= set(names), claim.key
        assert claim.candidate not in claim.rivals, claim.key
        assert claim.workload in WORKLOADS, claim.key
        assert claim.source, claim.key
        assert claim.repeats >= MIN_REPEATS, claim.key  # fewer could only tie
        for entrant in claim.entrants:  # every entrant runs an algorithm config (or is optional / required)
            assert entrant.optional or entrant.algorithm in claim.requires or algorithm_exists(entrant.algorithm)
        assert claim.capability or not claim.requires, claim.key


def test_every_claim_quotes_its_papers_abstract():
    for claim in CLAIMS:
        assert claim.statement.startswith('"'), claim.key
        assert '" (abstract' in claim.statement, claim.key
        assert "paraphrase" not in claim.statement, claim.key
    quotes = {claim.key: claim.statement.split('"')[1] for claim in CLAIMS}
    assert "Adaptive SGD outperforms four state-of-the-art solutions in time-to-accuracy" in quotes["adaptive_sgd"]
    assert "improves the training time" in quotes["crossbow"]
    assert "increases the convergence speed by 1.30x on average compared with the best baseline" in quotes["abs_sgd"]
    assert "faster convergence" in quotes["adaptive_hogbatch"]


@pytest.mark.parametrize("tiny", [False, True])
def test_every_claim_races_ddp_at_the_candidates_batch(tiny: bool):
    for claim in CLAIMS:
        assert same_batch_ddp(claim, tiny), claim.key
    crossbow = get_claims(["crossbow"])[0]
    assert same_batch_ddp(crossbow) == ["ddp_b64"]
    assert set(crossbow.rivals) == {"ddp_b64", "ddp_b512"}
    unfair = Claim(
        "k",
        "t",
        "s",
        '"x" (abstract)',
        "xmc_mini",
        "homogeneous",
        "sma_b64",
        ("ddp_b512",),
        (Entrant("sma_b64", ("algorithm=sma", "data.batch_size=64")), Entrant("ddp_b512", ("data.batch_size=512",))),
    )
    assert same_batch_ddp(unfair, tiny) == []


def test_the_headline_races_equal_batches_of_the_same_algorithm():
    claim = get_claims(["adaptive_sgd"])[0]
    equal = next(e for e in claim.entrants if e.name == "adaptive_sgd_equal")
    assert equal.selection() == ["algorithm=adaptive_sgd", "algorithm.planner=static"]
    assert Entrant("sma").selection() == ["algorithm=sma"]
    assert claim.profile == "strong"


def test_abs_sgd_lights_up_when_its_config_exists(tmp_path: Path):
    claim = get_claims(["abs_sgd"])[0]
    (tmp_path / "algorithm").mkdir()
    assert claim.missing(tmp_path) == ["abs_sgd"]
    (tmp_path / "algorithm" / "abs_sgd.yaml").write_text("{}\n")
    assert claim.missing(tmp_path) == []
    kept, left_out = claim.present_entrants(tmp_path)
    assert [e.name for e in kept] == ["abs_sgd", "ddp"]
    assert [e.name for e in left_out] == ["sync_adaptive"]
    (tmp_path / "algorithm" / "sync_adaptive.yaml").write_text("{}\n")
    assert [e.name for e in claim.present_entrants(tmp_path)[0]] == ["abs_sgd", "ddp", "sync_adaptive"]


def test_abs_sgd_runs_its_delay_from_the_first_validation_on():
    # XMC mini meets its target after 14 to 16 steps, inside abs_sgd.yaml's own warm-up: the race shortens it, so
    # that the comparison with sync_adaptive (the same sums, undelayed) measures the delay.
    claim = get_claims(["abs_sgd"])[0]
    assert (claim.workload, claim.profile, claim.target, claim.epochs) == ("xmc_mini", "strong", None, None)
    base = WORKLOADS[claim.workload].overrides()
    composed = {e.name: compose_config([*base, *e.selection(), *claim.overrides]) for e in claim.entrants}
    default = compose_config([*base, "algorithm=abs_sgd"]).algorithm.gradient_delay_warmup
    warmup = composed["abs_sgd"].algorithm.gradient_delay_warmup
    assert 0 < warmup < default
    assert composed["sync_adaptive"].algorithm.gradient_delay == 0
    for name, cfg in composed.items():  # every entrant validated alike, every `warmup` steps across epochs
        assert (cfg.trainer.val_check_interval, cfg.trainer.check_val_every_n_epoch) == (warmup, None), name


@pytest.mark.parametrize("key", [claim.key for claim in CLAIMS if claim.requires])
def test_a_claim_without_its_capability_is_not_implemented_and_not_raced(
    key: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    claim = get_claims([key])[0]
    monkeypatch.setattr(claims_module, "config_dir", lambda: tmp_path)  # no algorithm configs at all

    def no_race(settings: BenchSettings) -> BenchResult:
        raise AssertionError("a claim that is not implemented must not race")

    monkeypatch.setattr(program, "run_benchmark", no_race)
    result = measure_claim(claim, SeedsOptions(out=tmp_path))
    assert result.verdict.status == "not implemented"
    assert result.verdict.measured == (
        f"not implemented: {claim.capability} (configs/algorithm/{claim.requires[0]}.yaml missing)"
    )


def test_a_gpu_claim_on_a_machine_without_one_is_not_run_and_says_how_to_run_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    claim = get_claims(["crossbow_learners_gpu"])[0]

    def no_race(settings: BenchSettings) -> BenchResult:
        raise AssertionError("a claim that needs a GPU must not race without one")

    monkeypatch.setattr(program, "run_benchmark", no_race)
    monkeypatch.setattr(program.torch.cuda, "is_available", lambda: False)
    result = measure_claim(claim, SeedsOptions(out=tmp_path))
    assert result.verdict.status == "not run"
    assert "`python -m lightning_aesgd.bench seeds --claims crossbow_learners_gpu`" in result.verdict.measured


def test_the_gpu_crossbow_claim_races_one_learner_at_the_batch_of_one_four_and_eight():
    claim = get_claims(["crossbow_learners_gpu"])[0]
    assert (claim.workload, claim.profile, claim.needs_gpu) == ("fashion_mnist", "real", True)
    assert claim.overrides == ("experiment=gpu", "devices.num_replicas=1")
    assert same_batch_ddp(claim) == ["ddp_b64"]
    assert {name: entrant.batch_size() for name, entrant in ((e.name, e) for e in claim.entrants)} == {
        "crossbow_b64": "64",
        "ddp_b64": "64",
        "ddp_b256": "256",
        "ddp_b512": "512",
    }
    assert set(claim.rivals) == {"ddp_b64", "ddp_b256", "ddp_b512"}
    base = [*WORKLOADS[claim.workload].overrides(), f"devices={claim.profile}"]
    composed = {e.name: compose_config([*base, *e.selection(), *claim.overrides]) for e in claim.entrants}
    for name, cfg in composed.items():  # each on one GPU, the learners tuned up to 8
        assert (cfg.trainer.accelerator, cfg.trainer.devices, cfg.devices.num_replicas) == ("gpu", 1, 1), name
        assert cfg.data.batch_size == int(name.split("_b")[1]), name
    assert (
        composed["crossbow_b64"].algorithm.learners_per_device,
        composed["crossbow_b64"].algorithm.max_learners,
    ) == (
        "auto",
        8,
    )


def test_the_candidates_learners_are_read_from_its_runs_summaries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    claim = get_claims(["crossbow_learners_gpu"])[0]
    runs = [
        RunFigures("real", "crossbow_b64", i, time_to_target=t, final_metric=0.86, record=f"runs/c/repeat_{i}/r.json")
        for i, t in enumerate([1.0, 1.1, 1.2])
    ]
    chosen = [(4, [100.0, 180.0, 250.0, 330.0, 320.0]), (5, [100.0, 180.0, 250.0, 330.0, 340.0])]
    for i, (learners, measured) in enumerate(chosen):
        logs = tmp_path / claim.key / "runs" / "c" / f"repeat_{i}" / "logs"
        logs.mkdir(parents=True)
        summary = {"learners": {"per_replica": learners, "measured": measured}}
        (logs / "aesgd_summary.json").write_text(json.dumps(summary))
    cut = tmp_path / claim.key / "runs" / "c" / "repeat_2" / "logs"  # a summary cut short is left out, not fatal
    cut.mkdir(parents=True)
    (cut / "aesgd_summary.json").write_text('{"learners": {"per_')
    rivals = [RunFigures("real", name, 0, time_to_target=2.0, final_metric=0.86) for name in claim.rivals]
    monkeypatch.setattr(program, "run_benchmark", _fake_race([*runs, *rivals]))
    monkeypatch.setattr(program.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(program, "epochs_to_target", lambda *args: 1.0)
    monkeypatch.setattr(program.RunRecord, "load", staticmethod(lambda path: None))
    result = measure_claim(claim, SeedsOptions(out=tmp_path, repeats=3))
    assert result.verdict.measured.endswith(
        "learners per replica, by repeat: 4 (auto: 3.30× the samples/s of one), 5 (auto: 3.40× the samples/s of one)"
    )


def test_unknown_claims_are_named():
    with pytest.raises(KeyError, match="no_such_claim"):
        get_claims(["no_such_claim"])


# --- figures --------------------------------------------------------------------------------------------------


def test_epochs_to_target_counts_the_samples_before_the_validation():
    validations = [
        Validation(1.0, 1, 0, {"val/p@1": 0.2}),
        Validation(2.0, 3, 1, {"val/p@1": 0.7}),
        Validation(3.0, 4, 1, {"val/p@1": 0.9}),
    ]
    record = RunRecord(2, [1.0, 2.0, 3.0, 4.0], [100, 100, 100, 100], validations)
    assert epochs_to_target(record, Target("val/p@1", 0.6), epochs=2) == pytest.approx(1.5)
    assert epochs_to_target(record, Target("val/p@1", 0.95), epochs=2) is None
    assert epochs_to_target(RunRecord(), Target("val/p@1", 0.6), epochs=2) is None


def _five(name: str, start: float, epochs: float | None = None) -> Measured:
    times = tuple(start + 0.1 * i for i in range(5))
    return Measured(name, times=times, epochs=(epochs,) * 5, finals=(0.93,) * 5)


def test_crossbow_is_judged_on_the_clock_against_ddp_at_its_batch():
    claim = get_claims(["crossbow"])[0]
    measured = [
        _five("sma_b64", 20.0, epochs=0.5),  # fewest epochs, but the slowest clock
        _five("ddp_b64", 10.0, epochs=0.4),
        _five("ddp_b512", 12.0, epochs=2.0),
    ]
    verdict = judge(claim, measured, "val/p@1")
    assert (verdict.status, verdict.rival) == ("not reproduced", "ddp_b64")
    assert verdict.measured.endswith(
        "; median epochs to target (not judged): sma_b64 0.50 epochs, ddp_b64 0.40 epochs, ddp_b512 2.00 epochs"
    )


def test_judge_shows_controls_without_judging_them():
    claim = get_claims(["adaptive_sgd"])[0]
    claim = replace(claim, rivals=("ddp",))
    measured = [_five("adaptive_sgd", 4.0), _five("adaptive_sgd_equal", 1.0), _five("sma", 9.0), _five("ddp", 6.0)]
    verdict = judge(claim, measured, "val/p@1")
    assert verdict.status == "reproduced"  # the faster control is not judged
    assert verdict.measured.endswith(
        "; control (not judged): adaptive_sgd_equal 1.0–1.4 s (5 repeats), median 1.2 s, final 0.9300; "
        "sma 9.0–9.4 s (5 repeats), median 9.2 s, final 0.9300"
    )


def _runs(name: str, times: Sequence[float | None], crashed: int = 0) -> list[RunFigures]:
    finished = [
        RunFigures("strong", name, i, time_to_target=t, final_metric=0.93, record=None) for i, t in enumerate(times)
    ]
    broken = [RunFigures("strong", name, len(times) + i, error="RuntimeError: boom") for i in range(crashed)]
    return finished + broken


def _fake_race(runs: list[RunFigures], seen: list[BenchSettings] | None = None):
    def race(settings: BenchSettings) -> BenchResult:
        if seen is not None:
            seen.append(settings)
        return BenchResult(1.0, runs, [], "| race |", [])

    return race


def test_a_rival_whose_repeats_all_crashed_fails_the_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    times = [4.0, 4.1, 4.2, 4.3, 4.4]
    runs = [
        *_runs("adaptive_sgd", times),
        *_runs("adaptive_sgd_equal", [t + 2 for t in times]),
        *_runs("sma", [], crashed=5),
        *_runs("ddp", [t + 1 for t in times]),
    ]
    monkeypatch.setattr(program, "run_benchmark", _fake_race(runs))
    assert main(["seeds", "--claims", "adaptive_sgd", "--out", str(tmp_path)]) == 1
    assert "error: claim adaptive_sgd failed: every repeat of sma crashed" in capsys.readouterr().err
    results = json.loads((tmp_path / "seeds.json").read_text())
    (claim,) = results["claims"]
    assert claim["verdict"]["status"] == "failed"
    assert claim["measured"][2] == {
        "name": "sma",
        "times": [],
        "epochs": [],
        "finals": [],
        "crashed": 5,
        "repeats": 0,
        "time_to_target": None,
        "epochs_to_target": None,
        "final_metric": None,
    }


def test_every_repeat_is_measured_and_judged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    times = [4.0, 4.1, 4.2, 4.3, 4.4]
    runs = [
        *_runs("adaptive_sgd", times, crashed=1),
        *_runs("adaptive_sgd_equal", [t + 2 for t in times]),
        *_runs("sma", [t + 3 for t in times]),
        *_runs("ddp", [None, *[t + 1 for t in times[1:]]]),
    ]
    seen: list[BenchSettings] = []
    monkeypatch.setattr(program, "run_benchmark", _fake_race(runs, seen))
    result = measure_claim(get_claims(["adaptive_sgd"])[0], SeedsOptions(out=tmp_path))
    assert seen[0].repeats == 5
    assert [(m.name, m.repeats, m.crashed) for m in result.measured] == [
        ("adaptive_sgd", 5, 1),
        ("adaptive_sgd_equal", 5, 0),
        ("sma", 5, 0),
        ("ddp", 5, 0),
    ]
    assert result.measured[3].times == (None, 5.1, 5.2, 5.3, 5.4)
    assert result.verdict.status == "reproduced"
    assert result.verdict.spread.startswith("adaptive_sgd 4.0–4.4 s (5 repeats, 1 crashed), ddp 5.1–∞ s")


@pytest.mark.parametrize(
    ("argv", "repeats"),
    [([], 5), (["--quick"], 1), (["--tiny"], 1), (["--tiny", "--repeats", "3"], 3), (["--repeats", "7"], 7)],
)
def test_repeats_default_to_the_claims_own(
    argv: list[str], repeats: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    seen: list[BenchSettings] = []
    runs = [*_runs("adaptive_sgd", [1.0]), *_runs("adaptive_sgd_equal", [2.0]), *_runs("sma", [2.0])]
    monkeypatch.setattr(program, "run_benchmark", _fake_race([*runs, *_runs("ddp", [2.0])], seen))
    assert main(["seeds", "--claims", "adaptive_sgd", "--out", str(tmp_path), *argv]) == 0
    assert seen[0].repeats == repeats


def test_seeds_table_has_one_row_per_claim():
    claim = Claim("k", "A title", "Someone, 2020", '"It is fast."', "xmc_mini", "strong", "a", ("b",), (Entrant("a"),))
    verdict = Verdict("tie", "a 1.0 s = 0.50× b's", "b", "a 1.0–1.0 s (1 repeat), b 2.0–2.0 s (1 repeat)")
    table = seeds_table([ClaimResult(claim, verdict), ClaimResult(claim, not_implemented("x"))])
    assert table.splitlines() == [
        "| claim | paper says | rival | spread | we measured | verdict |",
        "|---|---|---|---|---|---|",
        '| A title (Someone, 2020) | "It is fast." | b | a 1.0–1.0 s (1 repeat), b 2.0–2.0 s (1 repeat) | '
        "a 1.0 s = 0.50× b's | **tie** |",
        '| A title (Someone, 2020) | "It is fast." | – | – | not implemented: x | **not implemented** |',
    ]


# --- end to end -----------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tiny_seeds_run_writes_the_table_and_verdicts(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    # A target every entrant reaches in the tiny data set, so that every run claim gets a real verdict.
    argv = ["seeds", "--tiny", "--claims", "crossbow,abs_sgd", "--target", "val/p@1=0.05", "--out", str(tmp_path)]
    assert main(argv) == 0

    results = json.loads((tmp_path / "seeds.json").read_text())
    claims = {claim["key"]: claim for claim in results["claims"]}
    assert list(claims) == ["crossbow", "abs_sgd"]
    crossbow = claims["crossbow"]
    assert crossbow["verdict"]["status"] == "tie"  # one repeat can tell nothing
    assert crossbow["verdict"]["rival"] in {"ddp_b64", "ddp_b512"}
    assert [m["name"] for m in crossbow["measured"]] == ["sma_b64", "ddp_b64", "ddp_b512"]
    for figures in crossbow["measured"]:
        assert (figures["repeats"], figures["crashed"]) == (1, 0)
        assert None not in (figures["time_to_target"], figures["epochs_to_target"], figures["final_metric"])
    if not algorithm_exists("abs_sgd"):
        assert claims["abs_sgd"]["verdict"]["status"] == "not implemented"

    table = (tmp_path / "seeds.md").read_text()
    assert table.startswith("| claim | paper says | rival | spread | we measured | verdict |")
    assert "## crossbow:" in table
    assert "| homogeneous | sma_b64 |" in table  # the claim's own race table
    assert (tmp_path / "crossbow" / "results.json").is_file()
    assert "| claim | paper says | rival | spread | we measured | verdict |" in capsys.readouterr().out


def test_the_hogbatch_claim_races_gpus_with_cpu_replicas_against_ddp_on_the_gpus_alone():
    claim = get_claims(["adaptive_hogbatch"])[0]
    assert (claim.candidate, claim.rivals, claim.profile, claim.needs_gpu) == ("hogbatch", ("ddp",), "gpu_cpu", True)
    assert claim.missing() == []
    base = [*WORKLOADS[claim.workload].overrides(), f"devices={claim.profile}"]
    composed = {e.name: compose_config([*base, *e.selection(), *claim.overrides]) for e in claim.entrants}
    hogbatch, ddp = composed["hogbatch"], composed["ddp"]
    assert (hogbatch.algorithm.sync, hogbatch.algorithm.replica_devices) == ("models", "auto")
    assert (ddp.algorithm.replica_devices, ddp.trainer.devices, ddp.trainer.accelerator) == (None, -1, "auto")
    assert ddp.algorithm._target_ == "lightning_aesgd.baselines.SharedDeviceDDPStrategy"
